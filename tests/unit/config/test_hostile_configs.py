"""Hostile config files: each yields its one exact line (file, key path, fix), quickly, never a traceback.

Every case writes real files into a temporary job folder and goes through the real loader; the
job-level cases go through `validate_job` and the ``flengine validate`` command.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from engine.cli import main
from engine.config import load_config, validate_job
from engine.config.limits import (
    MAX_CONFIG_FILE_BYTES,
    MAX_CONFIG_VALUES,
    MAX_FULL_HOCON_TOKENS,
    MAX_INCLUDES,
    MAX_NESTING_DEPTH,
)
from engine.errors import ConfigError

from .sample_job import META, SERVER, MakeJob

#: No hostile file may take longer than this to be refused (the slowest takes about 0.2 s).
REFUSAL_BOUND_S = 3.0
DEEP = 10_000
T = TypeVar("T")

DEPTH_HINT = "flatten it: a config needs a few levels, not dozens"
TOO_DEEP = f"objects and lists nest more than {MAX_NESTING_DEPTH} levels deep ({DEPTH_HINT})"
TOO_LARGE = (
    "the number is too large: beyond 1.8e308, or longer than 4300 digits "
    "(write a smaller number, or quote it to keep it as text)"
)
NOT_UTF8 = (
    "cannot read the file: 'utf-8' codec can't decode byte 0xff at line 2, column 5: "
    "invalid start byte (save the file as UTF-8)"
)
BIG_DATA_HINT = "keep big data (weights, sample lists) in a data file that the component reads, not in its config"
FULL_HOCON = (
    f"needs the full HOCON parser, which reads at most {MAX_FULL_HOCON_TOKENS} tokens, and this file and its "
    "includes hold more (an include, ${...}, +=, a duration or values side by side need it, and so does a "
    "syntax error) (write plain HOCON or JSON, which has no such limit, or move big data to a data file the "
    "component reads)"
)


def write(folder: Path, files: dict[str, str | bytes | None]) -> None:
    """Write ``files`` under ``folder``: text, bytes, or None for an empty folder."""
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


def quickly(step: Callable[[], T]) -> T:
    """Run ``step``, failing the test if it takes longer than `REFUSAL_BOUND_S`."""
    start = time.perf_counter()
    result = step()
    elapsed = time.perf_counter() - start
    assert elapsed < REFUSAL_BOUND_S, f"took {elapsed:.2f} s"
    return result


def refusal(folder: Path, name: str) -> list[str]:
    """The problem lines `load_config` raises for ``folder/name`` (the test fails if it loads)."""
    with pytest.raises(ConfigError) as caught:
        quickly(lambda: load_config(folder / name, name, folder))
    return [str(problem) for problem in caught.value.problems]


def nested(opening: str, closing: str, depth: int, inner: str = "1") -> str:
    return opening * depth + inner + closing * depth


HOSTILE_FILES = [
    pytest.param(
        {"a.conf": 'include "a.conf"\nx = 1\n'},
        "a.conf",
        ["a.conf:1: include 'a.conf' makes an include cycle: a.conf -> a.conf (remove one of these includes)"],
        id="include-itself",
    ),
    pytest.param(
        {"a.conf": 'x = 1\ninclude "b.conf"\n', "b.conf": 'include "a.conf"\n'},
        "a.conf",
        [
            "b.conf:1: include 'a.conf' makes an include cycle: a.conf -> b.conf -> a.conf (remove one of these includes)"
        ],
        id="include-cycle-a-b-a",
    ),
    pytest.param(
        {"a.conf": "x = " + nested("{ a = ", "}", DEEP)},
        "a.conf",
        [f"a.conf:1: x: {TOO_DEEP}"],
        id="deep-objects",
    ),
    pytest.param(
        {"a.conf": "x = " + nested("[", "]", DEEP)},
        "a.conf",
        [f"a.conf:1: x: {TOO_DEEP}"],
        id="deep-lists",
    ),
    pytest.param(
        {"a.conf": "x {\n  y = " + nested("[{ a = ", "}]", DEEP // 2) + "\n}\n"},
        "a.conf",
        [f"a.conf:2: x: {TOO_DEEP}"],
        id="deep-lists-of-objects",
    ),
    pytest.param(
        {"a.json": '{"x": ' + nested('{"a": ', "}", DEEP) + "}"},
        "a.json",
        [f"a.json:1: x: {TOO_DEEP}"],
        id="deep-json-objects",
    ),
    pytest.param(
        {"a.json": '{\n"x": ' + nested("[", "]", DEEP) + "}"},
        "a.json",
        [f"a.json:2: x: {TOO_DEEP}"],
        id="deep-json-lists",
    ),
    pytest.param(
        # substitutions send it to pyhocon, which would recurse about 30 frames a level
        {"a.conf": "y = 1\nx = " + nested("{ a = ", "}", DEEP, "${y}")},
        "a.conf",
        [f"a.conf:2: x: {TOO_DEEP}"],
        id="deep-with-substitutions",
    ),
    pytest.param(
        {"a.conf": 'include "deep.conf"\n', "deep.conf": "\n\nx = " + nested("[", "]", DEEP)},
        "a.conf",
        [f"deep.conf:3: x: {TOO_DEEP}"],
        id="deep-included-file",
    ),
    pytest.param(
        {"a.conf": "rounds = 3\nx = 1e999999\n"}, "a.conf", [f"a.conf:2: x: {TOO_LARGE}"], id="hocon-1e999999"
    ),
    pytest.param(
        {"a.conf": "x {\n  weights = [1, " + "1" * 5000 + "]\n}\n"},
        "a.conf",
        [f"a.conf:2: x.weights[1]: {TOO_LARGE}"],
        id="hocon-5000-digits",
    ),
    pytest.param(
        {"a.conf": "y = 2\nx = ${y}\nbig = -1e400\n"},
        "a.conf",
        [f"a.conf:3: big: {TOO_LARGE}"],
        id="hocon-too-large-with-substitutions",
    ),
    pytest.param({"a.json": '{"x": 1e999999}'}, "a.json", [f"a.json:1: x: {TOO_LARGE}"], id="json-1e999999"),
    pytest.param(
        {"a.json": '{\n  "a": {"b": [1, ' + "9" * 5000 + "]}\n}"},
        "a.json",
        [f"a.json:2: a.b[1]: {TOO_LARGE}"],
        id="json-5000-digits",
    ),
    pytest.param(
        {"a.json": '{"x": NaN}'},
        "a.json",
        ["a.json:1: x: NaN is not allowed in a config (write a number, or null)"],
        id="json-nan",
    ),
    pytest.param({"a.conf": b"x = 1\ny = \xff\n"}, "a.conf", [f"a.conf: {NOT_UTF8}"], id="not-utf8"),
    pytest.param(
        {"a.conf": 'include "b.conf"\n', "b.conf": b"x = 1\ny = \xff\n"},
        "a.conf",
        [f"b.conf: {NOT_UTF8}"],
        id="include-not-utf8",
    ),
    pytest.param(
        {"a.conf": 'x = 1\ninclude "shared"\n', "shared": None},
        "a.conf",
        ["a.conf:2: include 'shared': a folder, not a config file (name a .conf or .json file)"],
        id="include-a-folder",
    ),
    pytest.param(
        {"a.conf": 'include "missing.conf"\nx = 1\n'},
        "a.conf",
        ["a.conf:1: include 'missing.conf': no such file (fix the name, or ship the file with the job)"],
        id="include-missing",
    ),
    pytest.param(
        {"a.conf": 'include required("missing.conf")\nx = 1\n'},
        "a.conf",
        ["a.conf:1: include 'missing.conf': no such file (fix the name, or ship the file with the job)"],
        id="include-required-missing",
    ),
    pytest.param(
        {"a.conf": 'include "*.conf"\nx = 1\n', "b.conf": "y = 2\n"},
        "a.conf",
        [
            "a.conf:1: include '*.conf': wildcards are not supported (pyhocon would include every file they match) "
            "(name one file per include)"
        ],
        id="include-glob",
    ),
    pytest.param(
        {"a.conf": 'x = 1\ninclude ${HOME}"/x.conf"\n'},
        "a.conf",
        [
            'a.conf:2: include ${HOME}"/x.conf": an include names its file literally, never through ${...} '
            '(write the path: include "x.conf")'
        ],
        id="include-environment-variable",
    ),
    pytest.param(
        {"a.conf": 'include required(file(${?CONF_DIR}"/x.conf"))\n'},
        "a.conf",
        [
            'a.conf:1: include ${?CONF_DIR}"/x.conf": an include names its file literally, never through ${...} '
            '(write the path: include "x.conf")'
        ],
        id="include-required-file-environment-variable",
    ),
    pytest.param(
        {"a.conf": "x = 1\nbig = [" + "0, " * MAX_CONFIG_VALUES + "]\n"},
        "a.conf",
        [
            f"a.conf:2: big: more than {MAX_CONFIG_VALUES} values in one file (each scalar, list and object counts) ({BIG_DATA_HINT})"
        ],
        id="too-many-list-items",
    ),
    pytest.param(
        {"a.conf": "settings {\n" + "".join(f"  k{i} = {i}\n" for i in range(MAX_CONFIG_VALUES)) + "}\n"},
        "a.conf",
        [
            f"a.conf:{MAX_CONFIG_VALUES}: settings: more than {MAX_CONFIG_VALUES} values in one file "
            f"(each scalar, list and object counts) ({BIG_DATA_HINT})"
        ],
        id="too-many-keys",
    ),
    pytest.param(
        {"a.json": '{"big": [' + "{}, " * MAX_CONFIG_VALUES + "{}]}"},
        "a.json",
        [
            f"a.json:1: big: more than {MAX_CONFIG_VALUES} values in one file (each scalar, list and object counts) ({BIG_DATA_HINT})"
        ],
        id="too-many-json-values",
    ),
    pytest.param(
        {"a.conf": "rounds = ${?ROUNDS}\nbig = [" + ", ".join(["1"] * MAX_FULL_HOCON_TOKENS) + "]\n"},
        "a.conf",
        [f"a.conf:1: '${{?ROUNDS}}' {FULL_HOCON}"],
        id="too-big-for-pyhocon",
    ),
    pytest.param(
        {"a.conf": "big = [" + ", ".join(["1"] * MAX_FULL_HOCON_TOKENS) + "]\noops = = 1\n"},
        "a.conf",
        [f"a.conf:2: '= 1' {FULL_HOCON}"],
        id="syntax-error-in-a-big-file",
    ),
    pytest.param(
        {
            "a.conf": 'include "b.conf"\ninclude "b.conf"\n',
            **{
                f"{name}.conf": f'include "{after}.conf"\ninclude "{after}.conf"\n'
                for name, after in zip("bcdef", "cdefg", strict=True)
            },
            "g.conf": "x = 1\n",
        },
        "a.conf",
        [
            f"a.conf: follows 126 includes (a file included twice counts twice), at most {MAX_INCLUDES} "
            "(include each shared file once, from the main file)"
        ],
        id="includes-growing-exponentially",
    ),
    pytest.param(
        {
            "a.conf": "a0 = [1, 2, 3, 4]\n"
            + "".join(f"a{i} = [${{a{i - 1}}}, ${{a{i - 1}}}, ${{a{i - 1}}}]\n" for i in range(1, 16))
        },
        "a.conf",
        [
            f"a.conf: substitutions would expand this file to more than {MAX_CONFIG_VALUES} values "
            "(refer to big values once, not over and over)"
        ],
        id="substitutions-growing-exponentially",
    ),
]


@pytest.mark.parametrize(("files", "name", "expected"), HOSTILE_FILES)
def test_hostile_file_yields_its_exact_lines_quickly(
    tmp_path: Path, files: dict[str, str | bytes | None], name: str, expected: list[str]
) -> None:
    # Arrange
    write(tmp_path, files)

    # Act
    lines = refusal(tmp_path, name)

    # Assert
    assert lines == expected


def test_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # Arrange: a valid config, one byte too big
    text = "x = 1\n#" + "-" * (MAX_CONFIG_FILE_BYTES - 7) + "\n"
    write(tmp_path, {"a.conf": text})

    # Act
    lines = refusal(tmp_path, "a.conf")

    # Assert
    assert lines == [f"a.conf: the file is larger than {MAX_CONFIG_FILE_BYTES} bytes (16 MiB) ({BIG_DATA_HINT})"]


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    # Arrange: opening a named pipe would wait for a writer forever
    os.mkfifo(tmp_path / "pipe.conf")
    write(tmp_path, {"a.conf": 'include "pipe.conf"\n'})

    # Act
    lines = refusal(tmp_path, "a.conf")

    # Assert
    assert lines == [
        "a.conf:1: include 'pipe.conf': not a regular file, not a config file (name a .conf or .json file)"
    ]


@pytest.mark.parametrize(
    ("opening", "closing", "suffix"),
    [("{ a = ", "}", ".conf"), ("[", "]", ".conf"), ('{"a": ', "}", ".json"), ("[", "]", ".json")],
    ids=["objects", "lists", "json-objects", "json-lists"],
)
def test_nesting_up_to_the_limit_loads(tmp_path: Path, opening: str, closing: str, suffix: str) -> None:
    # Arrange
    key = '"x": ' if suffix == ".json" else "x = "
    text = key + nested(opening, closing, MAX_NESTING_DEPTH)
    write(tmp_path, {f"a{suffix}": "{" + text + "}" if suffix == ".json" else text})

    # Act
    document = quickly(lambda: load_config(tmp_path / f"a{suffix}", f"a{suffix}", tmp_path))

    # Assert
    value, depth = document.data["x"], 1
    while isinstance(value, (dict, list)):
        value = value["a"] if isinstance(value, dict) else value[0]
        depth += 1
    assert (value, depth) == (1, MAX_NESTING_DEPTH + 1)


def test_nesting_with_substitutions_up_to_the_limit_loads(tmp_path: Path) -> None:
    # Arrange: pyhocon reads it (a substitution), recursing far past Python's default limit
    write(tmp_path, {"a.conf": "y = 1\nx = " + nested("{ a = ", "}", MAX_NESTING_DEPTH, "${y}")})

    # Act
    document = quickly(lambda: load_config(tmp_path / "a.conf", "a.conf", tmp_path))

    # Assert
    assert str(document.data["x"]).count("{") == MAX_NESTING_DEPTH


def test_one_megabyte_list_loads_in_well_under_a_second(tmp_path: Path) -> None:
    # Arrange: about 150,000 items, which pyhocon alone takes minutes over
    items = ", ".join(str(i) for i in range(150_000))
    write(tmp_path, {"a.conf": f"# weights\nbig = [{items}]\nname = x\n"})

    # Act
    start = time.perf_counter()
    document = load_config(tmp_path / "a.conf", "a.conf", tmp_path)
    elapsed = time.perf_counter() - start

    # Assert
    assert len(document.data["big"]) == 150_000
    assert document.line_of(("big", 149_999)) == 2
    assert elapsed < 1.0


JOB_CASES = [
    pytest.param(
        {"meta.json": '{"name": "demo", "x": ' + nested("[", "]", DEEP) + "}", "meta.conf": None},
        [f"job/meta.json:1: x: {TOO_DEEP}"],
        id="deep-meta-json",
    ),
    pytest.param(
        {"meta.conf": META.replace("min_clients = 2", "min_clients = 1e999999")},
        [f"job/meta.conf:2: min_clients: {TOO_LARGE}"],
        id="meta-conf-number-too-large",
    ),
    pytest.param(
        {
            "app/config/config_fed_server.conf": 'include "common.conf"\n' + SERVER,
            "app/config/common.conf": 'include "config_fed_server.conf"\n',
        },
        [
            "job/app/config/common.conf:1: include 'config_fed_server.conf' makes an include cycle: "
            "job/app/config/config_fed_server.conf -> job/app/config/common.conf -> job/app/config/config_fed_server.conf "
            "(remove one of these includes)"
        ],
        id="server-config-include-cycle",
    ),
    pytest.param(
        {"app/config/config_fed_client.conf": 'include "../../missing.conf"\n'},
        [
            "job/app/config/config_fed_client.conf:1: include '../../missing.conf': no such file "
            "(fix the name, or ship the file with the job)"
        ],
        id="client-config-missing-include",
    ),
]


@pytest.mark.parametrize(("changes", "expected"), JOB_CASES)
def test_validate_job_lists_the_exact_lines(
    make_job: MakeJob, changes: dict[str, str | None], expected: list[str]
) -> None:
    # Arrange
    job = make_job(changes)

    # Act
    problems = quickly(lambda: validate_job(job, build=False, environment=False))

    # Assert
    assert [str(problem) for problem in problems] == expected


@pytest.mark.parametrize(("changes", "expected"), JOB_CASES)
def test_cli_prints_one_line_per_problem_and_no_traceback(
    make_job: MakeJob, capsys: pytest.CaptureFixture[str], changes: dict[str, str | None], expected: list[str]
) -> None:
    # Arrange
    job = make_job(changes)

    # Act
    code = quickly(lambda: main(["validate", str(job)]))

    # Assert
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out.splitlines() == [*expected, "job: 1 problem"]
    assert "Traceback" not in captured.err
