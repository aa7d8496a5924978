"""The ``flengine`` command: exit codes, one line per problem, no tracebacks, readable help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main

from .config.sample_job import MakeJob
from .config.test_job import BAD_INPUT, MORE_CASES

REPO = Path(__file__).resolve().parents[2]


def test_valid_job_prints_ok(make_job: MakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    make_job()

    code = main(["validate", "job"])

    assert code == 0
    assert capsys.readouterr().out == "job: ok\n"


def test_invalid_jobs_print_each_problem_and_exit_1(make_job: MakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    make_job()
    make_job({"meta.conf": 'min_clients = "two"\ndeploy_map { app = ["@ALL"] }\n'}, name="bad")

    code = main(["validate", "job", "bad"])

    assert code == 1
    assert capsys.readouterr().out.splitlines() == [
        "job: ok",
        'bad/meta.conf:1: min_clients: expected an integer, got "two"',
        "bad: 1 problem",
        "2 jobs checked, 1 invalid",
    ]


def test_help_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["validate", "--help"])

    out = capsys.readouterr().out
    assert caught.value.code == 0
    assert "usage: flengine validate [-h] [--format {text,json}] [-v] JOB [JOB ...]" in out
    assert "file:line: key.path: what is wrong (hint)" in out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main([])

    assert caught.value.code == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


def run_flengine(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_real_command_never_shows_a_traceback(make_job: MakeJob, tmp_path: Path) -> None:
    make_job({"app/config/config_fed_server.conf": "format_version = 2\nworkflows = [ { id = a, path = modle.X } ]\n"})
    (tmp_path / "empty").mkdir()

    result = run_flengine("validate", "job", "empty", "missing", cwd=tmp_path)

    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "job/app/config/config_fed_server.conf:2: workflows[0].path: cannot import 'modle.X': no module named 'modle' "
        "(check the spelling; the job's own code goes in the app's custom/ folder)",
        "job: 1 problem",
        "empty: the job folder is empty (a job needs meta.conf and an app folder with "
        "config/config_fed_server.conf and config/config_fed_client.conf)",
        "empty: 1 problem",
        "missing: no such job folder",
        "missing: 1 problem",
        "3 jobs checked, 3 invalid",
    ]


def test_jobs_of_the_repository_are_valid() -> None:
    jobs = sorted(str(p.relative_to(REPO)) for p in (REPO / "jobs").iterdir())

    result = run_flengine("validate", *jobs, cwd=REPO)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "jobs/fedavg: ok" in result.stdout.splitlines()


def test_every_bad_input_case_gives_its_lines_and_no_traceback(make_job: MakeJob, tmp_path: Path) -> None:
    cases = BAD_INPUT + MORE_CASES
    expected = []
    for case in cases:
        changes, lines = case.values
        make_job(changes, name=case.id)
        rename = {"job/": f"{case.id}/", "'job'": f"'{case.id}'", " in job:": f" in {case.id}:"}
        for line in lines:
            for old, new in rename.items():
                line = line.replace(old, new)
            expected.append(line)

    result = run_flengine("validate", *(case.id for case in cases), cwd=tmp_path)

    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    printed = result.stdout.splitlines()
    assert [line for line in expected if line not in printed] == []
    assert printed[-1] == f"{len(cases)} jobs checked, {len(cases)} invalid"


def test_the_executable_keeps_its_output_and_exit_code_when_it_skips_the_torch_teardown(tmp_path: Path) -> None:
    # Validating a job imports its components (torch among them); the exit then skips torch's
    # teardown, and nothing written may be lost on the way: the JSON is whole, the code is kept.
    good = subprocess.run(
        [sys.executable, "-m", "engine", "validate", str(REPO / "jobs" / "fedavg"), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    bad = subprocess.run(
        [sys.executable, "-m", "engine", "validate", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )

    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["jobs"][0]["ok"] is True
    assert bad.returncode == 1 and "no such job folder" in bad.stdout + bad.stderr
