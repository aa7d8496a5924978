"""`hocon_text`: what it writes reads back through engine.config exactly, whatever the strings hold."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import load_config
from engine.recipes.hocon import hocon_key, hocon_text

HOSTILE = {
    "quote": 'a"b',
    "substitution": "${HOME}",
    "optional-substitution": "${?HOME}",
    "newline": "line\nbreak",
    "carriage-return": "a\rb",
    "tab": "tab\there",
    "backslash": "back\\slash",
    "escaped-quote": '\\"',
    "hash-comment": "# not a comment",
    "slash-comment": "// nor this",
    "include": 'include "other.conf"',
    "dots": "a.b.c",
    "unicode": "ünï 中文 \u2028",
    "empty": "",
    "spaces": "  spaced  ",
    "true": "true",
    "duration": "10 seconds",
    "triple-quote": '"""x"""',
    "closing-brace": "} x = 1 {",
    "list": "[1, 2]",
    "unicode-escape": "\\u0041",
}


def read_back(tmp_path: Path, text: str) -> dict[str, Any]:
    file = tmp_path / "c.conf"
    file.write_text(text, encoding="utf-8")
    return load_config(file, "c.conf", tmp_path, environment=False).data


@pytest.mark.parametrize("value", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_string_value_reads_back_literally(tmp_path: Path, value: str) -> None:
    data = {"k": value, "nested": {"list": [value or "x", {"inner": value}]}}

    assert read_back(tmp_path, hocon_text(data)) == data


@pytest.mark.parametrize(
    "key", [k for k in HOSTILE.values() if k and '"' not in k and "\\" not in k and not set(k) & set("\t\n\r")]
)
def test_a_hostile_key_stays_one_key(tmp_path: Path, key: str) -> None:
    data = {"outer": {key: 1, "after": 2}}

    assert read_back(tmp_path, hocon_text(data)) == data


@pytest.mark.parametrize(
    ("key", "written"),
    [("num_rounds", "num_rounds"), ("a.b", '"a.b"'), ("include", '"include"'), ("true", '"true"'), ("x-y", '"x-y"')],
)
def test_only_a_plain_identifier_is_written_bare(key: str, written: str) -> None:
    assert hocon_key(key) == written


def test_numbers_booleans_and_null_keep_their_type(tmp_path: Path) -> None:
    data = {"i": 7, "big": 2**70, "f": 0.1, "tiny": 1e-05, "huge": 1e300, "neg": -2.5, "t": True, "n": None, "e": []}

    back = read_back(tmp_path, hocon_text(data))

    assert back == data
    assert [type(back[k]) for k in data] == [type(v) for v in data.values()]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"k": "bell\x07"}, r"config\['k'\]: the value 'bell\\x07' holds the character U\+0007"),
        ({"k": "a\bb"}, "U\\+0008"),
        ({"k": math.inf}, r"config\['k'\]: inf cannot be written"),
        ({"k": math.nan}, "nan cannot be written"),
        ({"": 1}, "an empty key"),
        ({'a"b': 1}, "holds a quote, a backslash or a line break"),
        ({"a\nb": 1}, "holds a quote, a backslash or a line break"),
        ({"k": {1: 2}}, "keys must be strings"),
        ({"k": {1, 2}}, "set cannot be written"),
        ({"k": ["x", ""]}, r"config\['k'\]\[1\]: an empty string in a list is dropped"),
        ({"k": b"bytes"}, "bytes cannot be written"),
    ],
    ids=[
        "bell",
        "backspace",
        "inf",
        "nan",
        "empty-key",
        "quote-key",
        "newline-key",
        "int-key",
        "set",
        "empty-in-list",
        "bytes",
    ],
)
def test_what_cannot_be_carried_is_refused_with_its_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        hocon_text(data)


def test_nesting_beyond_the_readers_limit_is_refused() -> None:
    data: dict[str, Any] = {"k": 1}
    for _ in range(80):
        data = {"k": data}

    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        hocon_text(data)


SAFE_TEXT = st.text(
    st.characters(
        blacklist_categories=("Cs",), blacklist_characters=[chr(c) for c in range(32) if chr(c) not in "\t\n\r"]
    ),
    max_size=12,
)
SAFE_KEY = st.text(
    st.characters(blacklist_categories=("Cs", "Cc")).filter(lambda c: c not in '"\\'), min_size=1, max_size=8
)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | SAFE_TEXT,
    lambda inner: st.lists(inner.filter(lambda v: v != ""), max_size=3) | st.dictionaries(SAFE_KEY, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(SAFE_KEY, VALUES, min_size=1, max_size=4))
def test_any_writable_document_reads_back_equal(tmp_path: Path, data: dict[str, Any]) -> None:
    assert read_back(tmp_path, hocon_text(data)) == data
