"""Locate keys and `include` directives in HOCON (or JSON) text, by line, for error messages.

pyhocon parses the configuration but forgets where each key was written, so this module runs a
light tokenizer and a recursive-descent walk of its own over the same text. It is best effort:
it never raises on malformed input (pyhocon reports syntax errors itself) and returns whatever
it could map.

`find_includes` is not best effort: it guards what pyhocon may read (a URL, a file outside the job
folder), so it errs the other way and searches the whole text, comments and strings included.

Example:
    >>> locate_keys("a {\\n  b.c = 1\\n}")
    {('a',): 1, ('a', 'b'): 2, ('a', 'b', 'c'): 2}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import NamedTuple

from pyhocon import ConfigParser

from engine.config.problems import KeyPath

_PUNCTUATION = "{}[],=:"
_INCLUDE_KINDS = ("file", "url", "classpath", "package")
_INCLUDE_CALLS = tuple(f"{name}(" for name in ("required", *_INCLUDE_KINDS))
_SEPARATORS = ("=", ":", "+=")
# An include as pyhocon's grammar reads it, with every keyword caseless (pyhocon's `include` is)
# and no closing parenthesis needed (pyhocon includes before it looks for them).
_INCLUDE_KEYWORD = re.compile(r"(?<![A-Za-z0-9_$])(?=include)", re.IGNORECASE)
_INCLUDE = re.compile(
    r"include[ \t]*(?:(?P<required>required)[ \t]*\([ \t]*)?"
    r"(?:(?P<kind>url|file|classpath|package)[ \t]*\([ \t]*)?"
    r'"(?P<target>(?:[^"\\\n]|\\.)*)"',
    re.IGNORECASE,
)
_ESCAPE = re.compile(r"\\.", re.DOTALL)
# An include whose target starts with a substitution: pyhocon's grammar wants a quoted string.
_SUBSTITUTED_INCLUDE = re.compile(
    r"include[ \t]*(?P<required>required[ \t]*\([ \t]*)?(?:(?P<kind>url|file|classpath|package)[ \t]*\([ \t]*)?"
    r"(?P<written>\$\{[^\n]*)",
    re.IGNORECASE,
)
# What the tokenizer skips in one step: the rest of a quoted string, of a ${...}, of unquoted
# text. Unquoted text ends at whitespace, punctuation, a quote, `#`, `$`, `//` or `+=` (HOCON
# spec); the rest of the spec's forbidden set (`^ ? ! @ * & \` ...) is kept inside the text so
# that odd input still makes progress.
_QUOTED_REST = re.compile(r'(?:[^"\\\n]++|\\(?s:.)?)*+')
_SUBSTITUTION_REST = re.compile(r'(?:[^}\n"]++|"(?:[^"\\\n]++|\\(?s:.)?)*+"?)*+')
_TEXT_REST = re.compile(r'(?:[^\s{}\[\],=:"#$/+]++|/(?!/)|\+(?!=))*+')
_WHITESPACE = re.compile(r"(?:[^\S\n]|\ufeff)++")


class _Token(NamedTuple):
    kind: str  # a punctuation mark, "+=", "nl", "ws", "string", "text", "subst" or "eof"
    text: str  # decoded content for "string", raw text otherwise
    line: int


@dataclass(frozen=True)
class IncludeDirective:
    """One `include` statement of a HOCON file.

    Attributes:
        target: The string inside the quotes, e.g. ``"common.conf"``, as pyhocon reads it.
        kind: ``"plain"`` for ``include "x.conf"``, else ``"file"``, ``"url"``, ``"classpath"``
            or ``"package"``.
        required: Whether the target is wrapped in ``required(...)``.
        line: 1-based line of the ``include`` keyword.
    """

    target: str
    kind: str
    required: bool
    line: int


def locate_keys(text: str) -> dict[KeyPath, int]:
    """Map every key path (object keys and array element indices) to the 1-based line where it is written.

    Dotted keys map each of their prefixes, a key written twice keeps its first line, and keys
    that only come from a substitution or an include are not mapped.

    Args:
        text: HOCON or JSON source.

    Returns:
        E.g. ``{("workflows",): 3, ("workflows", 0): 4, ("workflows", 0, "id"): 4, ...}``.
    """
    return _scan(text).lines


def find_includes(text: str) -> list[IncludeDirective]:
    """Return every include that pyhocon could follow in a HOCON text, in order.

    pyhocon follows an ``include`` wherever its grammar meets one: in any case, in an object, a
    value or an array, after a ``//`` that its keys may contain. Telling all of those apart means
    parsing as pyhocon does, so the whole text is searched instead: an include written in a
    comment or a string is reported too, which errs on the safe side.

    Args:
        text: HOCON source; includes are reported, not followed.
    """
    text = text.expandtabs()  # as pyparsing does before it parses: targets then read alike
    includes = []
    escapes = ConfigParser.REPLACEMENTS  # the escapes pyhocon resolves; it keeps other backslashes
    for keyword in _INCLUDE_KEYWORD.finditer(text):
        match = _INCLUDE.match(text, keyword.start())
        if match is None:
            continue
        target = _ESCAPE.sub(lambda m: escapes.get(m.group(0), m.group(0)), match.group("target"))
        kind = (match.group("kind") or "plain").lower()
        line = text.count("\n", 0, keyword.start()) + 1
        includes.append(IncludeDirective(target, kind, match.group("required") is not None, line))
    return includes


def without_includes(text: str) -> str:
    """``text`` with every include directive `find_includes` or `find_substituted_includes` sees blanked.

    Each directive is replaced by as many spaces as it has characters (its line breaks kept), so
    the rest of the file keeps its lines and columns: a file whose includes were refused can
    still be read for its other problems.
    """
    spans = [match.span() for match in _INCLUDE.finditer(text)]
    spans += [match.span() for match in _SUBSTITUTED_INCLUDE.finditer(text)]
    chars = list(text)
    for begin, end in spans:
        for index in range(begin, end):
            if chars[index] != "\n":
                chars[index] = " "
    return "".join(chars)


def find_substituted_includes(text: str) -> list[IncludeDirective]:
    """Return every include whose target is written with a substitution, e.g. ``include ${HOME}"/x.conf"``.

    pyhocon cannot read one (a syntax error), and which file a job reads must not depend on the
    environment anyway. The whole text is searched, as by `find_includes`.

    Args:
        text: HOCON source.

    Returns:
        The includes, each with ``target`` the rest of its line as written (``${HOME}"/x.conf"``).
    """
    includes = []
    for keyword in _INCLUDE_KEYWORD.finditer(text):
        match = _SUBSTITUTED_INCLUDE.match(text, keyword.start())
        if match is None:
            continue
        kind = (match.group("kind") or "plain").lower()
        line = text.count("\n", 0, keyword.start()) + 1
        target = match.group("written").rstrip().rstrip(")").rstrip()
        includes.append(IncludeDirective(target, kind, match.group("required") is not None, line))
    return includes


def _scan(text: str) -> _Walker:
    walker = _Walker(_tokenize(text))
    try:
        walker.walk_root()
    except RecursionError:  # absurdly deep nesting: keep what was mapped so far
        pass
    return walker


def _tokenize(text: str) -> list[_Token]:
    """Split HOCON text into tokens, dropping comments; always ends with an "eof" token."""
    tokens: list[_Token] = []
    i, line, n = 0, 1, len(text)
    while i < n:
        ch, start = text[i], i
        if ch == "#" or text.startswith("//", i):
            i = _find(text, "\n", i)
            continue
        if ch == "\n":
            kind, i = "nl", i + 1
        elif ch.isspace() or ch == "\ufeff":
            kind, i = "ws", _end_of(_WHITESPACE, text, i)
        elif text.startswith('"""', i):
            end = _find(text, '"""', i + 3)
            while text.startswith('"', end + 3):  # quotes just before the closing three are content
                end += 1
            kind, i = "string", min(end + 3, n)
        elif ch == '"':
            kind, i = "string", _end_of_quoted(text, i)
        elif text.startswith("${", i):
            kind, i = "subst", _end_of_substitution(text, i)
        elif text.startswith("+=", i):
            kind, i = "+=", i + 2
        elif ch in _PUNCTUATION:
            kind, i = ch, i + 1
        else:
            kind, i = "text", _end_of_text(text, i + 1)
        raw = text[start:i]
        tokens.append(_Token(kind, _string_content(raw) if kind == "string" else raw, line))
        line += text.count("\n", start, i)
    tokens.append(_Token("eof", "", line))
    return tokens


def _find(text: str, needle: str, start: int) -> int:
    """Index of `needle` in `text` from `start`, or the end of the text."""
    found = text.find(needle, start)
    return len(text) if found < 0 else found


def _end_of(pattern: re.Pattern[str], text: str, i: int) -> int:
    """Index just past what ``pattern`` (which may match nothing) matches at `i`."""
    match = pattern.match(text, i)
    assert match is not None
    return match.end()


def _end_of_quoted(text: str, i: int) -> int:
    """Index just past the quoted string opening at `i`; an unclosed one stops at the newline."""
    i = _end_of(_QUOTED_REST, text, i + 1)
    return i + 1 if i < len(text) and text[i] == '"' else i


def _end_of_substitution(text: str, i: int) -> int:
    """Index just past the ``${...}`` opening at `i`; an unclosed one stops at the newline."""
    i = _end_of(_SUBSTITUTION_REST, text, i + 2)
    return i + 1 if i < len(text) and text[i] == "}" else i


def _end_of_text(text: str, i: int) -> int:
    """Index just past the unquoted string that continues at `i`."""
    return _end_of(_TEXT_REST, text, i)


def _string_content(quoted: str) -> str:
    """The content of a quoted or triple-quoted string, with JSON escapes resolved."""
    if quoted.startswith('"""'):
        return quoted[3:-3] if len(quoted) >= 6 and quoted.endswith('"""') else quoted[3:]
    try:
        return json.loads(quoted, strict=False)
    except ValueError:  # unclosed, or an invalid escape: keep the raw text
        return quoted[1:-1] if len(quoted) > 1 and quoted.endswith('"') else quoted[1:]


class _Walker:
    """Recursive descent over the tokens, recording key lines."""

    def __init__(self, tokens: list[_Token]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.lines: dict[KeyPath, int] = {}
        # Current length of each array, so that `key += value` knows the index it appends at.
        self.array_lengths: dict[KeyPath, int] = {}

    @property
    def token(self) -> _Token:
        return self.tokens[self.pos]

    def skip(self, *kinds: str) -> None:
        while self.token.kind in kinds:
            self.pos += 1

    def record(self, path: KeyPath, line: int) -> None:
        self.lines.setdefault(path, line)

    def walk_root(self) -> None:
        self.skip("ws", "nl")
        if self.token.kind in ("{", "["):
            self.walk_value(())
        else:
            self.walk_object((), None)

    def walk_object(self, prefix: KeyPath, closing: str | None) -> None:
        """Walk fields up to `closing` (``"}"``, or None for a root without braces)."""
        while True:
            self.skip("ws", "nl", ",")
            kind = self.token.kind
            if kind == "eof":
                return
            if kind == closing:
                self.pos += 1
                return
            if kind in ("}", "]"):
                if closing is not None:
                    return  # an enclosing object or array owns this bracket
                self.pos += 1
            elif self.at_include():
                self.walk_include()
            elif kind in ("text", "string"):
                self.walk_field(prefix)
            else:
                self.pos += 1  # stray token where a key belongs

    def walk_field(self, prefix: KeyPath) -> None:
        """Walk ``key = value``, ``key += value`` or ``key { ... }``."""
        line = self.token.line
        path = prefix + self.read_key()
        self.skip("ws")
        if self.token.kind == "nl" and self.next_significant().kind == "{":
            self.skip("ws", "nl")
        separator = self.token.kind
        if separator not in (*_SEPARATORS, "{"):
            return  # a key without a value: leave the error to pyhocon
        for depth in range(len(prefix) + 1, len(path) + 1):
            self.record(path[:depth], line)
        if separator != "{":
            self.pos += 1
            self.skip("ws", "nl")
        if separator == "+=":
            index = self.array_lengths.get(path, 0)
            self.record((*path, index), line)
            self.array_lengths[path] = index + 1
            self.walk_value((*path, index))
        else:
            self.walk_value(path)

    def read_key(self) -> tuple[str, ...]:
        """Read a path expression: unquoted parts split on dots, quoted parts kept whole."""
        parts = [""]
        while True:
            token = self.token
            if token.kind == "ws" and self.tokens[self.pos + 1].kind in ("text", "string"):
                parts[-1] += token.text  # whitespace inside a key is part of it, around it is not
            elif token.kind == "string":
                parts[-1] += token.text
            elif token.kind == "text":
                first, *rest = token.text.split(".")
                parts[-1] += first
                parts.extend(rest)
            else:
                return tuple(parts)
            self.pos += 1

    def walk_value(self, path: KeyPath) -> None:
        """Walk one value: concatenated pieces up to a newline, a comma or a closing bracket."""
        array_length = 0
        while self.token.kind not in ("nl", ",", "}", "]", "eof"):
            if self.token.kind == "{":
                self.pos += 1
                self.walk_object(path, "}")
            elif self.token.kind == "[":
                array_length = self.walk_array(path, array_length)
                self.array_lengths[path] = array_length
            else:
                self.pos += 1

    def walk_array(self, path: KeyPath, first_index: int) -> int:
        """Walk ``[ ... ]`` whose elements start at `first_index`; return the next index."""
        self.pos += 1
        index = first_index
        while True:
            self.skip("ws", "nl", ",")
            kind = self.token.kind
            if kind == "eof" or kind == "}":  # "}" closes an enclosing object; leave it there
                return index
            if kind == "]":
                self.pos += 1
                return index
            self.record((*path, index), self.token.line)
            self.walk_value((*path, index))
            index += 1

    def next_significant(self) -> _Token:
        """The first token after the current one that is not whitespace or a newline."""
        pos = self.pos
        while self.tokens[pos].kind in ("ws", "nl"):
            pos += 1
        return self.tokens[pos]

    def at_include(self) -> bool:
        """Whether the current token starts an include directive rather than a key named include."""
        if self.token.kind != "text" or self.token.text != "include":
            return False
        after = self.tokens[self.pos + 1]
        if after.kind == "ws":
            after = self.tokens[self.pos + 2]
        if after.kind == "text":
            return after.text.startswith(_INCLUDE_CALLS)
        return after.kind == "string"

    def walk_include(self) -> None:
        """Consume an include directive up to the end of its line (`find_includes` reports it)."""
        self.pos += 1
        while self.token.kind in ("text", "string", "ws"):
            self.pos += 1
