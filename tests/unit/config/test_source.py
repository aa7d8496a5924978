"""Reading one config file: HOCON features, JSON, plain results, lines, refused includes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config
from engine.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_hocon_includes_substitutions_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLENGINE_TEST_ROUNDS", "7")
    write(tmp_path / "common" / "streaming.conf", "tensor_download_chunk_size = 8388608\n")
    conf = write(
        tmp_path / "app" / "server.conf",
        'include "../common/streaming.conf"\n'
        "base { hidden = 32 }\n"
        "model { args = ${base} }\n"
        "rounds = 3\n"
        "rounds = ${?FLENGINE_TEST_ROUNDS}\n"
        "missing = 1\n"
        "missing = ${?FLENGINE_TEST_UNSET_VARIABLE}\n",
    )

    document = load_config(conf, "server.conf", tmp_path)

    assert document.data == {
        "tensor_download_chunk_size": 8388608,
        "base": {"hidden": 32},
        "model": {"args": {"hidden": 32}},
        "rounds": "7",
        "missing": 1,
    }


def test_result_is_plain_python(tmp_path: Path) -> None:
    conf = write(tmp_path / "a.conf", 'a { "b.c" = [1, {d = null}] }\ntimeout = 10 minutes\n')

    document = load_config(conf, "a.conf", tmp_path)

    assert document.data == {"a": {"b.c": [1, {"d": None}]}, "timeout": 600}
    assert type(document.data["a"]) is dict
    assert type(document.data["a"]["b.c"]) is list


def test_lines_of_keys_are_kept(tmp_path: Path) -> None:
    conf = write(tmp_path / "a.conf", "x = 1\nworkflows = [\n  { id = a,\n    args { n = 1 } }\n]\n")

    document = load_config(conf, "a.conf", tmp_path)

    assert document.line_of(("workflows", 0, "args", "n")) == 4
    assert document.line_of(("workflows", 0, "args", "not_written")) == 4  # nearest written ancestor
    assert document.line_of(("nowhere",)) is None


def test_json_is_read_as_json(tmp_path: Path) -> None:
    conf = write(tmp_path / "a.json", '{\n  "format_version": 2,\n  "x": [true, null]\n}\n')

    document = load_config(conf, "a.json", tmp_path)

    assert document.data == {"format_version": 2, "x": [True, None]}
    assert document.line_of(("x",)) == 3


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        pytest.param("a.json", "[1, 2]", "a.json:1: the top level must be an object, got a list", id="json-list-root"),
        pytest.param(
            "a.conf",
            'include url("http://example.invalid/x.conf")\n',
            "a.conf:1: include url('http://example.invalid/x.conf'): only files inside the job folder may be included",
            id="include-url",
        ),
        pytest.param(
            "a.conf",
            'x = 1\ninclude "https://example.invalid/x.conf"\n',
            "a.conf:2: include 'https://example.invalid/x.conf': only files inside the job folder may be included",
            id="include-remote-string",
        ),
        pytest.param(
            "a.conf",
            'x = [1]\ny = 2 INCLUDE url ("https://example.invalid/x.conf")\n',
            "a.conf:2: include url('https://example.invalid/x.conf'): only files inside the job folder may be included",
            id="include-in-a-value-any-case",
        ),
        pytest.param(
            "a.conf",
            'include required(file("/etc/hostname"))\n',
            "a.conf:1: include file('/etc/hostname') reaches outside the job folder {root!r} (copy the shared file into the job folder)",
            id="include-absolute",
        ),
    ],
)
def test_refused_files(tmp_path: Path, name: str, text: str, expected: str) -> None:
    conf = write(tmp_path / name, text)

    with pytest.raises(ConfigError) as caught:
        load_config(conf, name, tmp_path)

    assert str(caught.value) == expected.format(root=str(tmp_path))


def test_nested_include_outside_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "shared" / "inner.conf", 'include "../../outside.conf"\n')
    conf = write(tmp_path / "app" / "a.conf", 'include "../shared/inner.conf"\n')

    with pytest.raises(ConfigError, match=r"^job/shared/inner.conf:1: include '../../outside.conf' reaches outside"):
        load_config(conf, "job/app/a.conf", tmp_path)


def test_symlink_out_of_the_job_is_refused(tmp_path: Path) -> None:
    outside = write(tmp_path / "outside" / "secret.conf", "x = 1\n")
    job = tmp_path / "job"
    job.mkdir()
    (job / "link.conf").symlink_to(outside)
    conf = write(job / "a.conf", 'include "link.conf"\n')

    with pytest.raises(ConfigError, match=r"reaches outside the job folder"):
        load_config(conf, "a.conf", job)


def test_unreadable_bytes_name_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "a.conf"
    conf.write_bytes(b"x = \xff\xfe\n")

    with pytest.raises(ConfigError, match=r"^a.conf: cannot read the file: 'utf-8' codec can't decode"):
        load_config(conf, "a.conf", tmp_path)
