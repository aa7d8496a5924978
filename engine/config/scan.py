"""One linear pass over a config file's text: its limits checked, and a plain file read without pyhocon.

pyhocon reads about 3,000 values a second (a 1 MB list takes minutes) and recurses about 30
frames per nesting level, so every config text goes through `scan_config` first. The scan
never recurses and never raises anything but `ConfigError`:

- it refuses a text nested deeper than `MAX_NESTING_DEPTH` or holding more than
  `MAX_CONFIG_VALUES` values, naming the line and, where it knows it, the key;
- for a *plain* HOCON text it builds the data and the line of every key itself, as pyhocon and
  `engine.config.locate.locate_keys` would: plain means ``key = value`` / ``key { ... }`` fields,
  lists, numbers, ``"strings"`` without escapes or tabs, unquoted words, true / false / null
  and comments, and nothing else (no include, ``${...}``, ``+=``, ``\"\"\"``, durations, value
  concatenation, or a key first set to a non-object and then to an object). Anything else, a
  syntax error included, stops the building and is left to pyhocon; the scan goes on measuring;
- for a JSON file (``json_file=True``) it builds nothing (`json.loads` does) and maps lines.

A list of plain scalars written JSON-style (``[1, 2.5, "x", true]``) is read in one step by
`json.loads`, which is what makes a 1 MB list take milliseconds.

Example:
    >>> scan_config("a { b = [1, 2] }", "a.conf").data
    {'a': {'b': [1, 2]}}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from engine.config.limits import MAX_CONFIG_VALUES, MAX_FULL_HOCON_TOKENS, MAX_NESTING_DEPTH
from engine.config.problems import KeyPath, Problem
from engine.errors import ConfigError, FlengineError


def _token_pattern(blanks: str) -> re.Pattern[str]:
    """One token, after the ``blanks`` and comment before it (neither means anything here).

    Every text ends with an "eof" token, and `other` takes any character nothing else does (a
    lone carriage return, ``$`` or backslash, an unclosed quote, odd whitespace), so a match
    never fails.
    """
    kinds = (
        r"(?P<nl>(?:\r?\n)++)",
        r'(?P<triple>"""(?s:.*?)"*"""|"""(?s:.*))',  # as pyhocon reads it; unclosed: to the end
        r'(?P<string>"(?:[^"\\\n]|\\.)*+")',
        r"(?P<subst>\$\{[^}\n]*+\}?+)",
        r"(?P<open>[{\[])",
        r"(?P<close>[}\]])",
        r"(?P<comma>,++)",
        r"(?P<sep>[=:]|\+=)",
        r'(?P<word>(?:[^\s{}\[\],=:"#$\\/+]|/(?!/)|\+(?!=))++)',
        r"(?P<eof>\Z)",
        r"(?P<other>(?s:.))",
    )
    return re.compile(rf"[{blanks}]*+(?:(?:#|//)[^\n]*+)?+(?:{'|'.join(kinds)})")


_TOKEN = _token_pattern(r" \t")
_JSON_TOKEN = _token_pattern(r" \t\r")  # JSON, unlike HOCON, takes a lone \r for a space
# A word pyhocon reads as a number (its own pattern), as true / false / null, or as a plain string.
_NUMBER = re.compile(r"[+-]?(\d*\.\d+|\d+(\.\d+)?)([eE][+\-]?\d+)?")
_KEYWORDS = {"true": True, "false": False, "null": None}
_KEYWORD_GLUED = re.compile(r"(?:true|false|null)(?![A-Za-z0-9_$])", re.IGNORECASE)  # `true-x`: pyhocon splits it
_UNQUOTED = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_KEY = re.compile(r"[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*")
# An include directive as `engine.config.locate` finds them (any case, anywhere), and one whose
# target is a substitution: the word `include` followed by a quote, `(`, or `${`.
_INCLUDE_KEYWORD = re.compile(r"(?<![A-Za-z0-9_$])include", re.IGNORECASE)
_INCLUDE_DIRECTIVE = re.compile(r'include[ \t]*+(?:["(]|\$\{|(?:required|url|file|classpath|package)\b)', re.IGNORECASE)
_BRACED_ROOT = re.compile(r"(?:\s|,|(?:#|//)[^\n]*+)*+\{")

# A list of scalars that JSON and pyhocon read alike: JSON numbers, strings without escapes or
# control characters (not "": pyhocon drops an empty string from a list), true / false / null,
# separated by commas and newlines, without comments. Possessive quantifiers (`*+`): the grammar
# never needs to backtrack, so a long list that turns out not to be one fails in linear time.
_JSON_SCALAR = r'-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][+-]?[0-9]++)?+|"[^"\\\x00-\x1f]++"|true|false|null'
_LIST_SEPARATOR = r"[ \t]*+(?:(?:,|\r?\n)[ \t]*+)++"
_LIST_BLANKS = r"(?:[ \t,]|\r?\n)*+"
_SCALAR_LIST = re.compile(
    rf"\[{_LIST_BLANKS}(?:(?:{_JSON_SCALAR})(?:{_LIST_SEPARATOR}(?:{_JSON_SCALAR}))*+)?+{_LIST_BLANKS}\]"
)
_SCALAR_ITEM = re.compile(_JSON_SCALAR)
# The commonest field, `key = scalar` up to the end of its line, read in one step.
_SIMPLE_FIELD = re.compile(
    r'[ \t]*+(?P<key>[A-Za-z0-9_\-]++(?:\.[A-Za-z0-9_\-]++)*+|"[^"\\\t\n]++")[ \t]*+[=:][ \t]*+'
    r'(?P<value>(?:[^\s{}\[\],=:"#$\\/+]|/(?!/)|\+(?!=))++|"(?:[^"\\\n]|\\.)*+")'
    r"[ \t]*+(?:(?:#|//)[^\n]*+)?+(?=\r?\n|[,}\]]|\Z)"
)

_DEPTH_HINT = "flatten it: a config needs a few levels, not dozens"
_VALUES_HINT = "keep big data (weights, sample lists) in a data file that the component reads, not in its config"


_MISSING = object()


class _NotPlain(FlengineError):
    """The text uses something beyond plain HOCON, or is malformed: pyhocon reads it (control flow here)."""


@dataclass
class ConfigScan:
    """What `scan_config` found.

    Attributes:
        data: The top-level value (an object, or a list) when the text is plain HOCON; None
            when pyhocon must read it, and always for a JSON file.
        key_lines: The line of each key path, as `locate_keys` maps it; None when the text is
            not plain (for a JSON file: not well-formed, and then nothing else is measured).
        values: How many values the text holds (each scalar, list and object counts as one).
        tokens: How many tokens it holds (values, keys, brackets, commas, ``=``, line ends);
            for a HOCON text that is not plain, counting stops past `MAX_FULL_HOCON_TOKENS`.
        depth: How deep objects and lists nest (``a { b = [1] }`` is 2 deep).
        full_hocon_line: The line where plain reading stopped, when it stopped.
        full_hocon_text: The text there (up to the end of its line, at most 40 characters).
    """

    data: Any = None
    key_lines: dict[KeyPath, int] | None = None
    values: int = 0
    tokens: int = 0
    depth: int = 0
    full_hocon_line: int | None = None
    full_hocon_text: str = ""


@dataclass(slots=True)
class _Slot:
    """Where a value goes: a key of an object, the end of a list, or nowhere (lines only)."""

    parent: dict[str, Any] | list[Any] | None
    key: str | None = None

    def put(self, value: Any) -> None:
        if isinstance(self.parent, list):
            self.parent.append(value)
        elif self.parent is not None:
            self.parent[self.key] = value  # a later value replaces an earlier one where it stood

    def object(self) -> dict[str, Any] | None:
        """The object to fill: an object already set here is merged into, as HOCON does."""
        if self.parent is None:
            return None
        old = _MISSING if isinstance(self.parent, list) else self.parent.get(self.key, _MISSING)
        if isinstance(old, dict):
            return old
        if old is not _MISSING:
            raise _NotPlain  # a scalar, list or null, then an object: pyhocon has its own rules
        new: dict[str, Any] = {}
        self.put(new)
        return new


@dataclass(slots=True)
class _Frame:
    """An open object or list."""

    kind: str  # "{" or "["
    value: Any  # the dict or list being built; None when only lines are mapped
    path: KeyPath
    braced: bool = True  # False for a root object written without braces
    index: int = 0  # a list's next index


@dataclass(slots=True)
class _Scanner:
    text: str
    display: str
    build: bool
    token: re.Pattern[str]
    pos: int = 0
    start: int = 0  # where the last token read starts
    line: int = 1
    values: int = 0
    tokens: int = 0
    depth: int = 0
    lines: dict[KeyPath, int] = field(default_factory=dict)
    stack: list[_Frame] = field(default_factory=list)


def scan_config(text: str, display: str, *, json_file: bool = False) -> ConfigScan:
    """Check ``text`` against the nesting and size limits; read it when it is plain HOCON.

    Args:
        text: The whole file, decoded.
        display: How to name the file in messages.
        json_file: The text is a ``.json`` file: map its lines only (`json.loads` reads it).

    Returns:
        The scan; see `ConfigScan` for what is set when.

    Raises:
        ConfigError: The text nests deeper than `MAX_NESTING_DEPTH` or holds more than
            `MAX_CONFIG_VALUES` values.
    """
    s = _Scanner(text, display, not json_file, _JSON_TOKEN if json_file else _TOKEN)
    include = None if json_file else _first_include(text)
    try:
        if include is not None:
            s.line = text.count("\n", 0, include) + 1
            s.start = include
            raise _NotPlain
        data = _read_plain(s)
    except _NotPlain:
        if json_file:
            return ConfigScan(None, None, s.values, s.tokens, s.depth)  # not JSON: json.loads says where
        token = _TOKEN.match(text, s.start)
        assert token is not None and token.lastgroup is not None
        at = text[token.start(token.lastgroup) :][:40].partition("\n")[0]
        line = s.line
        if include is not None:
            s.start = 0  # measured from the start
        _measure_rest(s)
        return ConfigScan(None, None, s.values, s.tokens, s.depth, line, at)
    return ConfigScan(data, s.lines, s.values, s.tokens, s.depth)


def _first_include(text: str) -> int | None:
    """Where the first include directive starts (as `find_includes` errs: comments and strings too), or None.

    The word alone changes nothing: pyhocon reads ``include = 1`` or ``a = include`` as a key and a
    string, as the plain reading does.
    """
    if "include" not in text.lower():
        return None
    for keyword in _INCLUDE_KEYWORD.finditer(text):
        if _INCLUDE_DIRECTIVE.match(text, keyword.start()):
            return keyword.start()
    return None


def _read_plain(s: _Scanner) -> Any:
    """Read the whole text as plain HOCON, or map the lines of a JSON text."""
    kind, token = _skip(s, _BLANKS)  # pyhocon allows no comma before a root's bracket
    root: dict[str, Any] | list[Any] | None = None
    if kind == "open":
        root = ({} if token == "{" else []) if s.build else None
        s.stack.append(_Frame(token, root, ()))
    else:
        s.pos = s.start
        root = {} if s.build else None
        s.stack.append(_Frame("{", root, (), braced=False))
    _count(s, 1, ())
    while s.stack:
        frame = s.stack[-1]
        if frame.kind == "{":
            _read_field(s, frame)
        else:
            _read_element(s, frame)
    if _skip(s, _BLANKS_AND_COMMAS)[0] != "eof":
        raise _NotPlain
    return root


_NOTHING: frozenset[str] = frozenset()
_BLANKS = frozenset(("nl",))
_BLANKS_AND_COMMAS = frozenset(("nl", "comma"))


def _next(s: _Scanner) -> tuple[str, str]:
    """Consume the next token: (kind, text)."""
    match = s.token.match(s.text, s.pos)
    assert match is not None and match.lastgroup is not None  # `eof` or `other` always matches
    s.start, s.pos = match.span()
    s.tokens += 1
    kind = match.lastgroup
    return kind, match[kind]


def _skip(s: _Scanner, kinds: frozenset[str]) -> tuple[str, str]:
    """Consume tokens of ``kinds`` (counting newlines) and the next one; return that one."""
    while True:
        kind, token = _next(s)
        if kind not in kinds:
            return kind, token
        if kind == "nl":
            s.line += token.count("\n")


def _read_field(s: _Scanner, frame: _Frame) -> None:
    """Read one field of the object ``frame``, or its end; a container value is only opened."""
    kind, token = _skip(s, _BLANKS_AND_COMMAS)
    if (kind == "eof" and not frame.braced) or (kind == "close" and token == "}" and frame.braced):
        _close(s)
        return
    key_line = s.line
    simple = _SIMPLE_FIELD.match(s.text, s.start) if s.build else None
    if simple is not None:
        _read_simple_field(s, frame, simple)
        return
    parts = _key(s, kind, token)
    kind, token = _skip(s, _NOTHING)
    if kind == "nl":
        s.line += token.count("\n")
        kind, token = _skip(s, _BLANKS)
        if token != "{":
            raise _NotPlain  # `a\n= 1`: pyhocon reads it, but locate_keys maps no line for it
    elif kind == "sep" and token != "+=":
        kind, token = _skip(s, _BLANKS)
    elif token != "{":
        raise _NotPlain
    path = frame.path + parts
    for end in range(len(frame.path) + 1, len(path) + 1):
        s.lines.setdefault(path[:end], key_line)
    _read_value(s, kind, token, path, _field_slot(frame.value, parts))


def _read_simple_field(s: _Scanner, frame: _Frame, simple: re.Match[str]) -> None:
    """Read a `key = scalar` field matched by `_SIMPLE_FIELD` (as `_read_field` would, faster)."""
    key, written = simple.group("key", "value")
    parts = (key[1:-1],) if key[0] == '"' else tuple(key.split("."))
    value = _scalar(s, "string" if written[0] == '"' else "word", written)
    path = frame.path + parts
    for end in range(len(frame.path) + 1, len(path) + 1):
        s.lines.setdefault(path[:end], s.line)
    _count(s, 1, path[:-1])
    _field_slot(frame.value, parts).put(value)
    s.pos = simple.end()
    s.tokens += 2


def _read_element(s: _Scanner, frame: _Frame) -> None:
    """Read one element of the list ``frame``, or its end; a container element is only opened."""
    kind, token = _skip(s, _BLANKS_AND_COMMAS)
    if kind == "close" and token == "]":
        _close(s)
        return
    if s.build and token == '""':
        raise _NotPlain  # pyhocon drops an empty string from a list
    path = (*frame.path, frame.index)
    frame.index += 1
    s.lines.setdefault(path, s.line)
    _read_value(s, kind, token, path, _Slot(frame.value))


def _key(s: _Scanner, kind: str, token: str) -> tuple[str, ...]:
    """The key path a key token spells: an unquoted key splits on dots, a quoted one does not."""
    if kind == "string":
        body = token[1:-1]
        if not s.build and "\\" in body:
            try:
                return (json.loads(token),)
            except ValueError:
                raise _NotPlain from None
        if s.build and (not body or "\\" in body or "\t" in body):
            raise _NotPlain  # pyhocon's escapes differ from JSON's, and it expands tabs
        return (body,)
    if kind == "word" and s.build and _KEY.fullmatch(token):
        return tuple(token.split("."))
    raise _NotPlain


def _field_slot(obj: dict[str, Any] | None, parts: tuple[str, ...]) -> _Slot:
    """The slot of ``a.b.c`` in ``obj``: ``a`` and ``b`` become objects, or merge into existing ones."""
    if obj is None:
        return _Slot(None)
    for part in parts[:-1]:
        obj = _Slot(obj, part).object()
        assert obj is not None
    return _Slot(obj, parts[-1])


def _read_value(s: _Scanner, kind: str, token: str, path: KeyPath, slot: _Slot) -> None:
    """Read the value that starts with ``token``; a container is opened for the main loop to fill."""
    if kind == "open":
        if token == "[" and _read_scalar_list(s, path, slot):
            _after_value(s)
            return
        if len(s.stack) > MAX_NESTING_DEPTH:
            _too_deep(s, path)
        if token == "{":
            value = slot.object()
        else:
            value = [] if s.build else None
            slot.put(value)
        s.stack.append(_Frame(token, value, path))
        s.depth = max(s.depth, len(s.stack) - 1)
        _count(s, 1, path[:-1])
        return
    value = _scalar(s, kind, token)
    _count(s, 1, path[:-1])
    slot.put(value)
    _after_value(s)


def _close(s: _Scanner) -> None:
    """End the innermost container; what follows it must end the value."""
    s.stack.pop()
    if s.stack:
        _after_value(s)


def _after_value(s: _Scanner) -> None:
    """After a value: a newline, a comma, a comment or a closing bracket; never another value."""
    kind, token = _skip(s, _NOTHING)
    if kind == "nl":
        s.line += token.count("\n")
    elif kind in ("comma", "close", "eof"):
        s.pos = s.start  # for the enclosing object or list to read
    else:
        raise _NotPlain  # concatenation (`a = 1 2`, `x = [1] [2]`, `10 minutes`) or a syntax error


def _scalar(s: _Scanner, kind: str, token: str) -> Any:
    """The value of a scalar token, as pyhocon reads it."""
    if not s.build:
        if kind in ("word", "string"):
            return None
        raise _NotPlain
    if kind == "string":
        body = token[1:-1]
        if "\\" in body or "\t" in body:
            raise _NotPlain
        return body
    if kind == "word":
        if _NUMBER.fullmatch(token):
            try:
                return int(token, 10)
            except ValueError:  # a fraction or an exponent; or past Python's digit limit: inf, as pyhocon
                return float(token)
        if token.lower() in _KEYWORDS:
            return _KEYWORDS[token.lower()]
        if _UNQUOTED.fullmatch(token) and not _KEYWORD_GLUED.match(token):
            return token
    raise _NotPlain


def _read_scalar_list(s: _Scanner, path: KeyPath, slot: _Slot) -> bool:
    """Read a list of plain scalars (its ``[`` just read) in one step, by `json.loads`; False if it is not one."""
    match = _SCALAR_LIST.match(s.text, s.pos - 1)
    if match is None:
        return False
    if len(s.stack) > MAX_NESTING_DEPTH:
        _too_deep(s, path)
    body = match.group()
    items: list[Any] | None = None
    item_lines: Any = repeat(s.line)
    if "\n" in body:
        written, item_lines = _items_by_line(body, s.line)
    else:
        try:
            items = json.loads(body)
        except ValueError:  # extra commas: JSON wants exactly one between items
            written = _SCALAR_ITEM.findall(body)
    count = len(items) if items is not None else len(written)
    _count(s, count + 1, path)  # before parsing: a list over the limit costs no more
    if items is None:
        try:
            items = json.loads(f"[{','.join(written)}]")
        except ValueError:  # an integer past Python's digit limit: read the slow way, as pyhocon does
            s.values -= count + 1
            return False
    s.tokens += 2 * count
    s.depth = max(s.depth, len(s.stack))
    keys = [(*path, index) for index in range(count)]
    if keys and keys[0] not in s.lines:
        s.lines.update(zip(keys, item_lines, strict=False))  # `repeat` never ends
    else:  # the key was set before: its first lines stay
        for key, line in zip(keys, item_lines, strict=False):
            s.lines.setdefault(key, line)
    slot.put(items if s.build else None)
    s.pos = match.end()
    s.line += body.count("\n")
    return True


def _items_by_line(body: str, first_line: int) -> tuple[list[str], list[int]]:
    """The items of a scalar list's text that starts on ``first_line``, and the line of each."""
    written: list[str] = []
    lines: list[int] = []
    for offset, text in enumerate(body.split("\n")):
        found = _SCALAR_ITEM.findall(text)  # no item spans lines
        written += found
        lines += [first_line + offset] * len(found)
    return written, lines


def _measure_rest(s: _Scanner) -> None:
    """Go on from the token plain reading stopped at, measuring nesting and values only.

    A HOCON text stops being measured past `MAX_FULL_HOCON_TOKENS`: pyhocon will not read it.
    """
    s.pos = s.start
    s.line = s.text.count("\n", 0, s.pos) + 1
    depth = len(s.stack) - 1 if s.stack else -1 if _BRACED_ROOT.match(s.text) else 0
    while True:
        kind, token = _next(s)
        if kind == "eof" or s.tokens > MAX_FULL_HOCON_TOKENS:
            return
        if kind == "nl":
            s.line += token.count("\n")
        elif kind == "open":
            depth += 1
            if depth > MAX_NESTING_DEPTH:
                _too_deep(s, ())
            s.depth = max(s.depth, depth)
            _count(s, 1, ())
        elif kind == "close":
            depth = max(depth - 1, 0)
        elif kind in ("word", "string", "triple", "subst"):
            _count(s, 1, ())
            s.line += token.count("\n")


def _too_deep(s: _Scanner, path: KeyPath) -> None:
    message = f"objects and lists nest more than {MAX_NESTING_DEPTH} levels deep"
    raise ConfigError([Problem(s.display, s.line, path[:1], message, _DEPTH_HINT)])


def _count(s: _Scanner, values: int, where: KeyPath) -> None:
    """Count ``values`` more, added to the object or list at ``where``; refuse past `MAX_CONFIG_VALUES`."""
    s.values += values
    if s.values > MAX_CONFIG_VALUES:
        message = f"more than {MAX_CONFIG_VALUES} values in one file (each scalar, list and object counts)"
        raise ConfigError([Problem(s.display, s.line, where, message, _VALUES_HINT)])
