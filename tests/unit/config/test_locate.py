"""Tests for `engine.config.locate`: key lines and include directives of HOCON and JSON text."""

from __future__ import annotations

import random
from pathlib import Path

import pyhocon.config_parser
import pytest
from pyhocon import ConfigFactory, ConfigTree

from engine.config.locate import IncludeDirective, find_includes, locate_keys
from engine.config.problems import KeyPath

SERVER_CONFIG = """\
format_version = 2
tensor_download_chunk_size = 2097152      # bytes
workflows = [
  { id = fedavg, path = engine.workflows.FedAvg,
    args { num_clients = 2, num_rounds = 3, download_to_disk = true } }
]
components = [
  { id = persistor, path = engine.persistors.PTFileModelPersistor,
    args { model { path = model.Net, args { hidden = 64 } } } }
]
"""

SCHEMAS = sorted((Path(__file__).parents[3] / "schemas").glob("*.json"))


def _pyhocon_paths(value: object, prefix: KeyPath = ()) -> set[KeyPath]:
    """Every key path (inner and leaf) of a value parsed by pyhocon."""
    paths: set[KeyPath] = {prefix} if prefix else set()
    if isinstance(value, ConfigTree):
        for key, child in value.items():
            # pyhocon keeps the quotes of a quoted key that holds a dot: '"a.b"'.
            name = key[1:-1] if len(key) > 1 and key.startswith('"') and key.endswith('"') else key
            paths |= _pyhocon_paths(child, (*prefix, name))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths |= _pyhocon_paths(child, (*prefix, index))
    return paths


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '# header\na = 1 // trailing\n// b = 2\nc = "x # not a comment" # real\nd = "//no"\n',
            {("a",): 2, ("c",): 4, ("d",): 5},
        ),
        ("url = http://example.com\nnext = 1", {("url",): 1, ("next",): 2}),
        (
            'a = "he said \\"}\\" and {"\n"x\\"y" = 2\nb = "[,]"\n',
            {("a",): 1, ('x"y',): 2, ("b",): 3},
        ),
        (
            'a = """line one\n{ not = structure }\nline three"""\nb = 2\nc = """q"""""\nd = 4',
            {("a",): 1, ("b",): 4, ("c",): 5, ("d",): 6},
        ),
        ("{\n  a = 1\n  b { c = 2 }\n}\n", {("a",): 2, ("b",): 3, ("b", "c"): 3}),
        (
            "a = 1\nb : 2\nc {\n  d = 3\n}\ne\n{ f = 4 }\ng =\n  5",
            {("a",): 1, ("b",): 2, ("c",): 3, ("c", "d"): 4, ("e",): 6, ("e", "f"): 7, ("g",): 8},
        ),
        (
            "a = [1, 2]\na += 3\nb += x",
            {("a",): 1, ("a", 0): 1, ("a", 1): 1, ("a", 2): 2, ("b",): 3, ("b", 0): 3},
        ),
        (
            'a.b.c = 1\na.b.d = 2\n"x.y" = 3\nm."n.o".p = 4\nkey with spaces = 5',
            {
                ("a",): 1,
                ("a", "b"): 1,
                ("a", "b", "c"): 1,
                ("a", "b", "d"): 2,
                ("x.y",): 3,
                ("m",): 4,
                ("m", "n.o"): 4,
                ("m", "n.o", "p"): 4,
                ("key with spaces",): 5,
            },
        ),
        (
            "xs = [\n  1\n  2, 3\n  [4,\n   5]\n]\nys = [1] [2]\nzs = []",
            {
                ("xs",): 1,
                ("xs", 0): 2,
                ("xs", 1): 3,
                ("xs", 2): 3,
                ("xs", 3): 4,
                ("xs", 3, 0): 4,
                ("xs", 3, 1): 5,
                ("ys",): 7,
                ("ys", 0): 7,
                ("ys", 1): 7,
                ("zs",): 8,
            },
        ),
        (
            "workflows = [ { id = x, args { n = 1 } },\n  { id = y } ]",
            {
                ("workflows",): 1,
                ("workflows", 0): 1,
                ("workflows", 0, "id"): 1,
                ("workflows", 0, "args"): 1,
                ("workflows", 0, "args", "n"): 1,
                ("workflows", 1): 2,
                ("workflows", 1, "id"): 2,
            },
        ),
        (
            "base { n = 1 }\na = ${base} { m = 2 }\nb = ${?HOME}/data\n"
            "c = hello world, d = -10.5e3\n"
            'e = true\nf = null\ng = "x" ${base.n} y\nh = ${ "quoted}" }\ni = 1',
            {
                ("base",): 1,
                ("base", "n"): 1,
                ("a",): 2,
                ("a", "m"): 2,
                ("b",): 3,
                ("c",): 4,
                ("d",): 4,
                ("e",): 5,
                ("f",): 6,
                ("g",): 7,
                ("h",): 8,
                ("i",): 9,
            },
        ),
        (
            "a { x = 1 }\nb = 2\na { x = 3, y = 4 }\na.z = 5",
            {("a",): 1, ("a", "x"): 1, ("b",): 2, ("a", "y"): 3, ("a", "z"): 4},
        ),
        (
            'include "a.conf"\nb = 1\nc { include required(file("d.conf"))\n  e = 2 }\ninclude = 3',
            {("b",): 2, ("c",): 3, ("c", "e"): 4, ("include",): 5},
        ),
        (
            '{"a": [1, {"b": 2}],\n "c": {"d": null, "e.f": "g"},\n "h": [\n  "i"\n ]\n}',
            {
                ("a",): 1,
                ("a", 0): 1,
                ("a", 1): 1,
                ("a", 1, "b"): 1,
                ("c",): 2,
                ("c", "d"): 2,
                ("c", "e.f"): 2,
                ("h",): 3,
                ("h", 0): 4,
            },
        ),
        ("[{a = 1},\n 2]", {(0,): 1, (0, "a"): 1, (1,): 2}),
        ("\ufeffa = 1\r\nb {\r\n  c = 2\r\n}\r\n", {("a",): 1, ("b",): 2, ("b", "c"): 3}),
        ("", {}),
    ],
    ids=[
        "comments",
        "double-slash-in-unquoted-value-is-a-comment",
        "quoted-strings-with-escapes",
        "triple-quoted-strings",
        "root-in-braces",
        "separators",
        "append",
        "dotted-and-quoted-keys",
        "arrays",
        "objects-in-arrays",
        "values-skipped",
        "duplicate-keys-keep-first-line",
        "includes-skipped",
        "json",
        "root-array",
        "bom-and-crlf",
        "empty",
    ],
)
def test_locate_keys_maps_each_path_to_its_line(text: str, expected: dict[KeyPath, int]) -> None:
    # Act
    lines = locate_keys(text)

    # Assert
    assert lines == expected


@pytest.mark.parametrize(
    ("path", "line"),
    [
        (("format_version",), 1),
        (("tensor_download_chunk_size",), 2),
        (("workflows",), 3),
        (("workflows", 0), 4),
        (("workflows", 0, "path"), 4),
        (("workflows", 0, "args", "num_rounds"), 5),
        (("workflows", 0, "args", "download_to_disk"), 5),
        (("components", 0, "id"), 8),
        (("components", 0, "args", "model", "path"), 9),
        (("components", 0, "args", "model", "args", "hidden"), 9),
    ],
    ids=lambda value: ".".join(map(str, value)) if isinstance(value, tuple) else str(value),
)
def test_locate_keys_in_a_server_config(path: KeyPath, line: int) -> None:
    # Act
    lines = locate_keys(SERVER_CONFIG)

    # Assert
    assert lines[path] == line


@pytest.mark.parametrize(
    "text",
    [
        SERVER_CONFIG,
        '{"a": [1, {"b": 2}], "c": {"d": null, "e.f": "g"}, "h": []}',
        'a.b.c = 1\na.b.d = 2\n"x.y" = 3\nkey with spaces = 4\nm { n.o = 5 }',
        '# c\na = 1 // c\nb = """x\n{ y = 1 }\n"""\nc = [\n  1\n  [2, 3]\n  { d = 4 }\n]\ne = [1] [2]',
        "a { x = 1 }\nb = 2\na { x = 3, y { z = 4 } }\nc\n{ d = 5 }\ne =\n  6",
        "base = 1\na = ${base}\nb = ${?FLENGINE_TEST_SURELY_UNSET} [1]\nc = hello world, d = true",
        "[{a = 1}, [2, {b = 3}]]",
    ],
    ids=[
        "server-config",
        "json",
        "dotted-keys",
        "comments-and-arrays",
        "merges",
        "substitutions",
        "root-array",
    ],
)
def test_locate_keys_covers_every_path_pyhocon_parses(text: str) -> None:
    # Arrange
    parsed = ConfigFactory.parse_string(text)

    # Act
    lines = locate_keys(text)

    # Assert
    assert _pyhocon_paths(parsed) - lines.keys() == set()


@pytest.mark.parametrize("schema", SCHEMAS, ids=[path.name for path in SCHEMAS])
def test_locate_keys_covers_every_path_of_the_shipped_schemas(schema: Path) -> None:
    # Arrange
    text = schema.read_text(encoding="utf-8")
    parsed = ConfigFactory.parse_string(text)

    # Act
    lines = locate_keys(text)

    # Assert
    assert _pyhocon_paths(parsed) - lines.keys() == set()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a {\n  b = 1\n  c = [1,\n", {("a",): 1, ("a", "b"): 2, ("a", "c"): 3, ("a", "c", 0): 3}),
        ("a = [\n  { b = 1\n]\nc = 2", {("a",): 1, ("a", 0): 2, ("a", 0, "b"): 2, ("c",): 4}),
        ('a = "oops\nb = 2', {("a",): 1, ("b",): 2}),
        ('a = """oops\nb = 2', {("a",): 1}),
        ("a = ${oops\nb = 2", {("a",): 1, ("b",): 2}),
        ("a = 1 }\n] b = 2\nc", {("a",): 1, ("b",): 2}),
        ("= = : , }{][ += ${", {}),
        ("a = " + "[" * 5000, {("a",): 1, ("a", 0): 1}),
    ],
    ids=[
        "unclosed-brace",
        "unclosed-brace-in-array",
        "unclosed-string",
        "unclosed-triple-quoted-string",
        "unclosed-substitution",
        "stray-closers",
        "punctuation-only",
        "deep-nesting",
    ],
)
def test_locate_keys_maps_what_it_can_of_malformed_text(text: str, expected: dict[KeyPath, int]) -> None:
    # Act
    lines = locate_keys(text)

    # Assert
    assert expected.items() <= lines.items()


def test_locate_keys_never_raises_on_a_truncated_config() -> None:
    # Arrange
    text = SERVER_CONFIG + 'include required(file("x.conf"))\nnote = """a\nb"""\n'

    # Act / Assert: every prefix is a plausible half-written file.
    for end in range(len(text) + 1):
        locate_keys(text[:end])
        find_includes(text[:end])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('include "x.conf"', [IncludeDirective("x.conf", "plain", False, 1)]),
        ('\ninclude file("x.conf")', [IncludeDirective("x.conf", "file", False, 2)]),
        ('include url("http://h/x.conf")', [IncludeDirective("http://h/x.conf", "url", False, 1)]),
        ('include classpath("x.conf")', [IncludeDirective("x.conf", "classpath", False, 1)]),
        ('include package("pkg:x.conf")', [IncludeDirective("pkg:x.conf", "package", False, 1)]),
        ('include required(file("x.conf"))', [IncludeDirective("x.conf", "file", True, 1)]),
        ('include required( "x.conf" )', [IncludeDirective("x.conf", "plain", True, 1)]),
        (
            'a = 1\nb {\n  c = [{ include "in-array.conf" }]\n  include file("in-object.conf")\n}\ninclude "last.conf"',
            [
                IncludeDirective("in-array.conf", "plain", False, 3),
                IncludeDirective("in-object.conf", "file", False, 4),
                IncludeDirective("last.conf", "plain", False, 6),
            ],
        ),
        ('{\n  include "root.conf"\n}', [IncludeDirective("root.conf", "plain", False, 2)]),
        ('a = "include \\"y.conf\\""\ninclude = 3\nb = include\nc = include_all "x"', []),
        ('include nope("y.conf")\ninclude\n"z.conf"\nx = we include them\ninclude("a")', []),
        # pyhocon includes "a" before it finds the rest malformed; "x.conf" errs on the safe side
        (
            'include file("x.conf"\ninclude "a" "b"',
            [IncludeDirective("x.conf", "file", False, 1), IncludeDirective("a", "plain", False, 2)],
        ),
        # every place pyhocon follows an include, which a lighter scan would miss
        ('INCLUDE url("http://h")', [IncludeDirective("http://h", "url", False, 1)]),
        ('include url ( "http://h" )', [IncludeDirective("http://h", "url", False, 1)]),
        ('x = 1 include "http://h"', [IncludeDirective("http://h", "plain", False, 1)]),
        ('x = [1, include "http://h"]', [IncludeDirective("http://h", "plain", False, 1)]),
        ('a = foo//bar include "http://h"', [IncludeDirective("http://h", "plain", False, 1)]),
        ('a //b = 1, include "http://h"', [IncludeDirective("http://h", "plain", False, 1)]),
        ('# comment\rinclude "http://h"', [IncludeDirective("http://h", "plain", False, 1)]),
        ('a = ${"} include "http://h"', [IncludeDirective("http://h", "plain", False, 1)]),
        ('x = 1 // """\nk //y = 1, include "http://h"\n"""', [IncludeDirective("http://h", "plain", False, 2)]),
        # reported though pyhocon would not follow it: the safe side
        ('# include "x.conf"\nd = "include \\"z.conf\\""', [IncludeDirective("x.conf", "plain", False, 1)]),
        (
            'include "a\\tb\\u0041"\ninclude\t"c"',
            [IncludeDirective("a\tb\\u0041", "plain", False, 1), IncludeDirective("c", "plain", False, 2)],
        ),
    ],
    ids=[
        "plain",
        "file",
        "url",
        "classpath",
        "package",
        "required-file",
        "required-plain",
        "nested-in-order",
        "braced-root",
        "not-includes",
        "not-includes-for-pyhocon",
        "malformed-but-read",
        "caseless",
        "spaced-call",
        "in-a-value",
        "in-an-array",
        "after-double-slash-in-a-value",
        "after-double-slash-in-a-key",
        "after-a-carriage-return",
        "after-a-quote-in-a-substitution",
        "after-a-string-opened-in-a-comment",
        "in-a-comment",
        "pyhocon-escapes-and-tabs",
    ],
)
def test_find_includes(text: str, expected: list[IncludeDirective]) -> None:
    # Act
    includes = find_includes(text)

    # Assert
    assert includes == expected


# Pieces of HOCON that change how a scanner sees what follows: comments, strings, substitutions.
_FRAGMENTS = ['include', 'INCLUDE', ' "h"', '"', "//", "#", "\r", "\n", "${", "}", "=", "a", " ", "\t", ",", "[", "]",
              "{", "url(", "url", "(", ")", "\\", "required(", "file(", ":", "+=", "1", '"""', "$", "x.y", "/"]  # fmt: skip


def _random_texts(count: int) -> list[str]:
    rng = random.Random(20240611)
    texts = ["".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(2, 12))) for _ in range(count)]
    return [text for text in texts if "include" in text.lower()]


def test_find_includes_finds_every_include_pyhocon_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    # pyhocon itself is the oracle: every file, URL or package it would read is recorded instead.
    reads: list[str] = []
    factory, parser = pyhocon.config_parser.ConfigFactory, pyhocon.config_parser.ConfigParser
    monkeypatch.setattr(factory, "parse_URL", classmethod(lambda cls, url, **_: reads.append(url) or []))
    monkeypatch.setattr(factory, "parse_file", classmethod(lambda cls, name, *_, **__: reads.append(name) or []))
    monkeypatch.setattr(parser, "resolve_package_path", classmethod(lambda cls, name: reads.append(name) or "/none"))
    missed = []

    for text in _random_texts(1000):
        reads.clear()
        try:
            ConfigFactory.parse_string(text, basedir="", resolve=False)
        except Exception:  # noqa: BLE001, S110 - most random texts are malformed; pyhocon reads before it fails
            pass
        found = {include.target for include in find_includes(text)}
        missed += [(text, read) for read in reads if read not in found]

    assert missed == []
