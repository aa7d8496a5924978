"""Property-based tests of config loading: any file loads or raises `ConfigError`, quickly; data round-trips.

Random text, bytes and fragments of HOCON syntax, written as ``.conf`` and ``.json`` files, must
either load or raise `ConfigError`, never anything else and never slowly. Random JSON-like
documents, written as JSON and as HOCON in several styles, must load back as the same data,
with the same key lines, as pyhocon and `locate_keys` read them (the plain-HOCON fast path of
`engine.config.scan` must change nothing a valid config means).
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyhocon import ConfigFactory, ConfigTree
from pyhocon.config_tree import NoneValue

from engine.config import load_config
from engine.config.limits import MAX_NESTING_DEPTH
from engine.config.locate import locate_keys
from engine.errors import ConfigError

FUZZ = settings(
    max_examples=150,
    deadline=timedelta(seconds=2),  # a hang or a quadratic blow-up fails the example
    suppress_health_check=[HealthCheck.too_slow],
)

# Pieces that change how HOCON reads what follows: comments, strings, substitutions, brackets.
FRAGMENTS = [
    *("a", "b.c", '"k"', '"a.b"', "1", "-2.5", "1e999", "true", "null", "x-y", "10 m", "é"),
    *("=", ":", "+=", "{", "}", "[", "]", ",", "\n", "\r\n", "\r", " ", "\t", "\ufeff"),
    *("# c\n", "// c\n", '"', '"""', "\\", "$", "${a}", "${?HOME}", "include", ' "x.conf"', "required(", ")"),
]
HOCON_TEXT = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)
ANY_TEXT = st.text(max_size=300) | st.text(st.sampled_from(list('{}[],:="\\$#/+ \n\tab1.-')), max_size=300)

KEYS = st.text(st.sampled_from(list("abcxyz_-. 019") + ["é"]), min_size=1, max_size=8)
STRINGS = st.text(st.characters(exclude_categories=("Cs", "Cc")), min_size=1, max_size=12)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | STRINGS
    | st.from_regex(r"[a-z_][a-z0-9_.]{0,8}", fullmatch=True)  # what HOCON may leave unquoted
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(KEYS, children, max_size=5),
    max_leaves=30,
)
DOCUMENTS = st.dictionaries(KEYS, VALUES, max_size=6)

_BARE_KEY = re.compile(r"[a-z_][a-z0-9_-]*")
_BARE_WORD = re.compile(r"[a-z_][a-z0-9_.]*")
_KEYWORD = re.compile(r"(true|false|null|include)", re.IGNORECASE)


@contextmanager
def config_file(name: str, content: str | bytes) -> Iterator[Path]:
    """A fresh folder holding one config file ``name`` (Hypothesis runs many examples per test)."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        path = Path(folder) / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        yield path


def load_or_refuse(path: Path) -> None:
    """Load ``path``; a `ConfigError` is a fine answer, any other exception fails the test."""
    try:
        load_config(path, path.name, path.parent, environment=False)
    except ConfigError as e:
        assert e.problems, "a ConfigError lists its problems"
        assert all(str(problem).startswith(path.name) for problem in e.problems)


@FUZZ
@given(text=HOCON_TEXT | ANY_TEXT, name=st.sampled_from(["a.conf", "a.json"]))
def test_any_text_loads_or_raises_config_error(text: str, name: str) -> None:
    with config_file(name, text) as path:
        load_or_refuse(path)


@FUZZ
@given(data=st.binary(max_size=300), name=st.sampled_from(["a.conf", "a.json"]))
def test_any_bytes_load_or_raise_config_error(data: bytes, name: str) -> None:
    with config_file(name, data) as path:
        load_or_refuse(path)


@FUZZ
@given(
    depth=st.integers(0, 3 * MAX_NESTING_DEPTH),
    brackets=st.lists(st.sampled_from(["[", "{ a = ", '{"a": ']), min_size=1, max_size=3),
    name=st.sampled_from(["a.conf", "a.json"]),
)
def test_nesting_loads_up_to_the_limit_and_is_refused_past_it(depth: int, brackets: list[str], name: str) -> None:
    # Arrange: `depth` levels, cycling through the brackets; HOCON-only ones make invalid JSON
    openings = [brackets[i % len(brackets)] for i in range(depth)]
    closings = "".join("]" if opening == "[" else "}" for opening in reversed(openings))
    text = '{"x": ' + "".join(openings) + "1" + closings + "}"

    with config_file(name, text) as path:
        # Act
        try:
            document = load_config(path, name, path.parent)
        except ConfigError as e:
            # Assert: refused for its depth, or (HOCON brackets in a .json file) for its syntax
            assert depth > MAX_NESTING_DEPTH or name == "a.json", str(e)
            return
    assert depth <= MAX_NESTING_DEPTH
    assert "x" in document.data


@FUZZ
@given(document=DOCUMENTS, indent=st.sampled_from([None, 2]), name=st.sampled_from(["a.json", "a.conf"]))
def test_json_documents_round_trip(document: dict[str, Any], indent: int | None, name: str) -> None:
    # Arrange
    text = json.dumps(document, indent=indent, ensure_ascii=False)

    with config_file(name, text) as path:
        # Act
        loaded = load_config(path, name, path.parent)

    # Assert
    assert same(loaded.data, document)
    assert loaded.key_lines == locate_keys(text)


@FUZZ
@given(document=DOCUMENTS, style=st.data())
def test_hocon_documents_round_trip_as_pyhocon_reads_them(document: dict[str, Any], style: st.DataObject) -> None:
    # Arrange: written in HOCON with its freedoms (unquoted keys and words, `key { }`, newlines
    # for commas, dotted keys, comments), each chosen at random
    text = to_hocon(document, style, top=True)

    with config_file("a.conf", text) as path:
        # Act
        loaded = load_config(path, "a.conf", path.parent)

    # Assert
    assert same(loaded.data, document)
    assert same(loaded.data, plain(ConfigFactory.parse_string(text)))
    assert loaded.key_lines == locate_keys(text)


def to_hocon(value: Any, style: st.DataObject, top: bool = False) -> str:
    """``value`` written as HOCON, in a style ``style`` draws."""
    if isinstance(value, dict):
        separator = style.draw(st.sampled_from(["\n", ", ", ",\n", " # note\n"]))
        fields = separator.join(field(key, item, style) for key, item in value.items())
        return fields + "\n" if top else "{" + fields + "}"
    if isinstance(value, list):
        separator = style.draw(st.sampled_from([", ", "\n", ",\n  "]))
        return "[" + separator.join(to_hocon(item, style) for item in value) + "]"
    if isinstance(value, str) and _BARE_WORD.fullmatch(value) and not _KEYWORD.match(value):
        return value if style.draw(st.booleans()) else json.dumps(value)
    return json.dumps(value, ensure_ascii=False)


def field(key: str, value: Any, style: st.DataObject) -> str:
    written = key if _BARE_KEY.fullmatch(key) and style.draw(st.booleans()) else json.dumps(key, ensure_ascii=False)
    if isinstance(value, dict) and len(value) == 1 and written == key and style.draw(st.booleans()):
        ((inner_key, inner_value),) = value.items()
        if _BARE_KEY.fullmatch(inner_key):  # `a.b = 1` for `a { b = 1 }`
            return f"{key}.{inner_key} = {to_hocon(inner_value, style)}"
    if isinstance(value, dict) and style.draw(st.booleans()):
        return f"{written} {to_hocon(value, style)}"
    return f"{written} {style.draw(st.sampled_from(['=', ':']))} {to_hocon(value, style)}"


def plain(value: Any) -> Any:
    """pyhocon's tree as plain data."""
    if isinstance(value, ConfigTree):
        return {key[1:-1] if key[:1] == key[-1:] == '"' and len(key) > 1 else key: plain(v) for key, v in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return None if isinstance(value, NoneValue) else value


def same(a: Any, b: Any) -> bool:
    """Equal, with types: True is not 1, and 1.0 is not 1."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b
