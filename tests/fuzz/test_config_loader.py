"""Fuzzing the config loader on the files of real job folders, as a server reads a job it received.

`load_config` must return a document or raise `ConfigError` for any bytes in a ``.conf`` or
``.json`` file; `load_job` (with ``build=False, environment=False``, what a server or a site
does with a job that came over the network) must return a job or raise `ConfigError`. The
inputs are the config files of the jobs under ``jobs/`` with bytes broken and pieces of HOCON
syntax (substitutions, includes, triple quotes, brackets) spliced in.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.config import load_config, load_job
from engine.errors import ConfigError

from .strategies import FUZZ, mutated, scaled

JOBS = Path(__file__).resolve().parents[2] / "jobs"
CONFIG_FILES = sorted(JOBS.glob("*/meta.conf")) + sorted(JOBS.glob("*/app*/config/*.conf"))
FILE_TEXTS = {path.relative_to(JOBS).as_posix(): path.read_bytes() for path in CONFIG_FILES}

# Pieces that change how HOCON reads what follows.
FRAGMENTS = [
    *(
        "${a}",
        "${?HOME}",
        "${workflows}",
        "${components[0]}",
        "include",
        ' include "x.conf"\n',
        "include required(",
        ")",
    ),
    *('"""', '"', "\\", "{", "}", "[", "]", ",", "=", ":", "+=", "\n", "# c\n", "// c\n", "\ufeff", "\x00"),
    *("1e999", "-0", "9" * 5000, "true", "null", "[" * 300, "{a=" * 300, "${a}" * 50, "a.b.c.d.e.f"),
]


@st.composite
def spliced(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """``valid`` with up to three fragments of HOCON syntax inserted or written over it."""
    data = draw(valid)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        piece = draw(st.sampled_from(FRAGMENTS)).encode()
        cut = draw(st.sampled_from([0, 0, len(piece)]))  # insert, or overwrite as many bytes
        data = data[:at] + piece + data[at + cut :]
    return data


def as_json(text: bytes) -> bytes:
    """A config file's data written as JSON (for the ``.json`` loader), through pyhocon."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        path = Path(folder) / "a.conf"
        path.write_bytes(text)
        return json.dumps(load_config(path, "a.conf", path.parent).data, indent=1).encode()


NAMES = st.sampled_from(sorted(FILE_TEXTS))
VALID = NAMES.map(FILE_TEXTS.__getitem__)
BROKEN = mutated(VALID) | spliced(VALID) | mutated(spliced(VALID))


def load_or_refuse(content: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        path = Path(folder) / name
        path.write_bytes(content)
        try:
            load_config(path, name, path.parent, environment=False)
        except ConfigError as e:
            assert e.problems and all(str(problem).startswith(name) for problem in e.problems)


@FUZZ
@given(content=BROKEN, suffix=st.sampled_from([".conf", ".json"]))
@example(content=b"a = " + b"[" * 100_000, suffix=".conf")
@example(content=b'{"a": ' + b"[" * 100_000, suffix=".json")
@example(content=b"a = ${b}\nb = ${a}\n", suffix=".conf")
# Crash found by this property: an integer past Python's 4300-digit limit followed by more text
# made the JSON loader's second reading raise JSONDecodeError outside its handler.
@example(content=b"9" * 5000 + b"{}", suffix=".json")
def test_broken_config_files_load_or_raise_config_error(content: bytes, suffix: str) -> None:
    load_or_refuse(content, "config" + suffix)


@scaled(15)
@given(content=mutated(VALID.map(as_json)) | spliced(VALID.map(as_json)))
def test_broken_json_configs_load_or_raise_config_error(content: bytes) -> None:
    load_or_refuse(content, "config.json")


@scaled(15)
@given(file=NAMES, content=st.data())
def test_a_received_job_with_a_broken_file_loads_or_raises_config_error(file: str, content: st.DataObject) -> None:
    # Arrange: a copy of the job, one of its config files broken
    job_name, relative = file.split("/", 1)
    broken = content.draw(mutated(st.just(FILE_TEXTS[file])) | spliced(st.just(FILE_TEXTS[file])))
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        job = Path(shutil.copytree(JOBS / job_name, Path(folder) / job_name))
        (job / relative).write_bytes(broken)

        # Act / Assert
        try:
            load_job(job, build=False, environment=False)
        except ConfigError as e:
            assert e.problems


def test_a_huge_integer_followed_by_text_is_a_json_syntax_problem(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"9" * 5000 + b'{"a": 1}')

    with pytest.raises(ConfigError, match=r"^config.json:1: invalid JSON: Extra data at column 5001"):
        load_config(path, "config.json", tmp_path)
