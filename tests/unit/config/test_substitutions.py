"""Substitutions in a job sent to a server: answered by the job's files, never by the environment."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pyhocon.config_parser
import pytest
from pyhocon import ConfigFactory

from engine.config import inspect_job, load_config
from engine.config.substitutions import environment_references, resolve
from engine.errors import ConfigError

from .sample_job import MakeJob

NO_ENV = "; a job sent to a server may not read its environment"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "a = 1\nname = ${?HOME}\n",
            f"a.conf:2: name: refers to ${{?HOME}}, which this file does not define{NO_ENV}"
            " (define HOME in the file, or write the value itself)",
            id="optional",
        ),
        pytest.param(
            "model { args { path = ${HOME}/data } }\n",
            f"a.conf:1: model.args.path: refers to ${{HOME}}, which this file does not define{NO_ENV}"
            " (define HOME in the file, or write the value itself)",
            id="required-in-a-concatenation",
        ),
        pytest.param(
            "PATH = ${?PATH}:/opt/bin\n",
            f"a.conf:1: PATH: refers to ${{?PATH}}, which this file does not define{NO_ENV}"
            " (define PATH in the file, or write the value itself)",
            id="self-reference-with-nothing-before",
        ),
        pytest.param(
            "HOME += [1]\n",
            f"a.conf:1: HOME: appends to HOME with +=, which this file does not define before{NO_ENV}"
            " (give HOME a value before, e.g. HOME = [])",
            id="append-to-nothing",
        ),
        pytest.param(
            "a = null\nHOME = ${a}\n",
            f"a.conf:2: HOME: refers to ${{a}}, which this file sets to null (pyhocon then reads the environment)"
            f"{NO_ENV} (write the value itself)",
            id="null",
        ),
        pytest.param(
            "workflows = [{ args { secret = ${?HOME} } }]\n",
            f"a.conf:1: workflows[0].args.secret: refers to ${{?HOME}}, which this file does not define{NO_ENV}"
            " (define HOME in the file, or write the value itself)",
            id="in-a-list",
        ),
    ],
)
def test_a_substitution_of_the_environment_is_refused(tmp_path: Path, text: str, expected: str) -> None:
    conf = write(tmp_path / "a.conf", text)

    with pytest.raises(ConfigError) as caught:
        load_config(conf, "a.conf", tmp_path, environment=False)

    assert str(caught.value) == expected


def test_a_substitution_the_file_defines_is_resolved(tmp_path: Path) -> None:
    write(tmp_path / "common.conf", "rounds = 3\n")
    conf = write(
        tmp_path / "a.conf",
        'include "common.conf"\n'
        "base { hidden = 32 }\n"
        "model { args = ${base} }\n"
        "num_rounds = ${rounds}\n"
        "label = ${?base.hidden}-wide\n"
        "tags = [a]\n"
        "tags += [b]\n",
    )

    document = load_config(conf, "a.conf", tmp_path, environment=False)

    assert document.data == {
        "rounds": 3,
        "base": {"hidden": 32},
        "model": {"args": {"hidden": 32}},
        "num_rounds": 3,
        "label": "32-wide",
        "tags": ["a", "b"],
    }


def test_by_default_the_environment_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLENGINE_TEST_SECRET", "s3cret")
    conf = write(tmp_path / "a.conf", "name = ${?FLENGINE_TEST_SECRET}\nmissing = ${?FLENGINE_TEST_UNSET_VARIABLE}\n")

    assert load_config(conf, "a.conf", tmp_path).data == {"name": "s3cret"}
    with pytest.raises(ConfigError, match=r"refers to \$\{\?FLENGINE_TEST_SECRET\}"):
        load_config(conf, "a.conf", tmp_path, environment=False)


def test_a_substitution_in_an_included_file_is_reported_there(tmp_path: Path) -> None:
    write(tmp_path / "shared" / "common.conf", "x = 1\nsecret = ${?HOME}\n")
    conf = write(tmp_path / "app" / "a.conf", 'include "../shared/common.conf"\ny = 2\n')

    with pytest.raises(ConfigError) as caught:
        load_config(conf, "job/app/a.conf", tmp_path, environment=False)

    assert [(p.file, p.line, p.key_path) for p in caught.value.problems] == [("job/shared/common.conf", 2, ("secret",))]


def test_a_job_read_for_a_server_does_not_see_its_environment(
    make_job: MakeJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLENGINE_TEST_SECRET", "s3cret")
    job_dir = make_job({"meta.conf": 'name = ${?FLENGINE_TEST_SECRET}\ndeploy_map { app = ["@ALL"] }\n'})

    job, problems = inspect_job(job_dir, build=False, environment=False)
    default_job, _ = inspect_job(job_dir)

    assert job is None
    assert [str(p) for p in problems] == [
        f"job/meta.conf:1: name: refers to ${{?FLENGINE_TEST_SECRET}}, which this file does not define{NO_ENV}"
        " (define FLENGINE_TEST_SECRET in the file, or write the value itself)"
    ]
    assert default_job is not None and default_job.name == "s3cret"


# Ways a HOCON file can make pyhocon read the environment, and look-alikes that do not.
PYHOCON_CASES = {
    "optional": "name = ${?VAR}",
    "required": "name = ${VAR}",
    "defined": "a = 1\nb = ${a}",
    "self-reference": "VAR = ${?VAR}",
    "self-reference-concatenated": "VAR = ${?VAR} x",
    "self-reference-earlier-value": "VAR = 1\nVAR = ${VAR}2",
    "append-list": "VAR += [1]",
    "append-string": "VAR += x",
    "append-after-a-value": "VAR = [0]\nVAR += [1]",
    "append-nested": "x { VAR += [1] }",
    "nested-self-reference-missing": "VAR { x = ${?VAR.y} }",
    "nested-self-reference-null": "VAR { y = null, x = ${VAR.y} }",
    "nested-self-reference-defined": "VAR { y = 1, x = ${VAR.y} }",
    "dotted-self-reference": "VAR.b = ${?VAR}",
    "self-reference-in-an-object": "VAR { b = ${?VAR} }",
    "null-chain": "a = null\nVAR = ${a}\nc = ${VAR}",
    "null-chain-optional": "a = null\nVAR = ${?a}\nc = ${?VAR}",
    "chain-to-missing": "VAR = ${?zz}\nc = ${?VAR}",
    "overridden": "a = ${?VAR}\na = 1",
    "overridden-object": "a { b = ${?VAR} }\na { c = 1 }",
    "object-concatenation": "a { x = 1 }\nb = ${a} { y = ${?VAR} }",
    "list-element": "l = [${?VAR}]",
    "list-concatenation": "a = [1]\nb = ${a} [${?VAR}]",
    "string-concatenation": 'a = "x"${?VAR}"y"',
    "through-a-scalar": "a = 1\nb = ${?a.VAR}",
    "quoted": 'c = ${"VAR"}',
    "cycle": "a = ${?b}\nb = ${?a}",
}


@pytest.mark.parametrize("text", PYHOCON_CASES.values(), ids=PYHOCON_CASES.keys())
def test_every_read_of_the_environment_is_found(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # pyhocon itself is the oracle: every name it looks up in os.environ is recorded.
    reads: list[str] = []

    class RecordingEnviron(dict[str, str]):
        def get(self, key: str, default: str | None = None) -> str:  # type: ignore[override]
            reads.append(key)
            return f"value of {key}"

    recording_os = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    recording_os.environ = RecordingEnviron()
    monkeypatch.setattr(pyhocon.config_parser, "os", recording_os)
    try:
        ConfigFactory.parse_string(text)
    except Exception:  # noqa: BLE001 - a cycle is an error; what matters is what was read first
        pass
    pyhocon_read = bool(reads)
    reads.clear()

    tree = ConfigFactory.parse_string(text, resolve=False)
    found = environment_references(tree)
    if not found:
        try:
            resolve(tree, environment=False)
        except Exception:  # noqa: BLE001 - as above
            pass

    assert found or not pyhocon_read, "pyhocon reads the environment here, unnoticed"
    assert reads == [], "resolving without the environment read it"
