"""``--format json`` of ``flengine validate`` and ``flengine run``, and ``-v`` after the command.

With ``--format json`` stdout holds exactly one JSON document: the report, or
``{"error": ..., "exit_code": N}`` when the command could not start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import _parser, main
from tests.integration.runtime.jobkit import make_bench_job

from .config.sample_job import MakeJob

REPO = Path(__file__).resolve().parents[2]
BAD_META = {"meta.conf": 'min_clients = "two"\ndeploy_map { app = ["@ALL"] }\n'}
BAD_META_PROBLEM = {
    "file": "bad/meta.conf",
    "line": 1,
    "key_path": "min_clients",
    "message": 'expected an integer, got "two"',
    "hint": None,
}


def run_flengine(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_validate_json_lists_every_job_with_its_problems(make_job: MakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    make_job()
    make_job(BAD_META, name="bad")

    code = main(["validate", "job", "bad", "--format", "json"])

    assert code == 1
    assert json.loads(capsys.readouterr().out) == {
        "jobs": [
            {"job": "job", "ok": True, "problems": []},
            {"job": "bad", "ok": False, "problems": [BAD_META_PROBLEM]},
        ],
        "checked": 2,
        "invalid": 1,
    }


def test_validate_json_of_a_real_job_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    job = str(REPO / "jobs" / "fedavg")

    code = main(["validate", "--format=json", job])

    assert code == 0
    assert json.loads(capsys.readouterr().out) == {
        "jobs": [{"job": job, "ok": True, "problems": []}],
        "checked": 1,
        "invalid": 0,
    }


def test_validate_json_names_the_key_path_of_a_nested_problem(
    make_job: MakeJob, capsys: pytest.CaptureFixture[str]
) -> None:
    make_job({"app/config/config_fed_server.conf": "format_version = 2\nworkflows = [ { id = a, path = modle.X } ]\n"})

    code = main(["validate", "job", "--format", "json"])

    (problem,) = json.loads(capsys.readouterr().out)["jobs"][0]["problems"]
    assert code == 1
    assert problem["file"] == "job/app/config/config_fed_server.conf"
    assert problem["line"] == 2
    assert problem["key_path"] == "workflows[0].path"
    assert problem["message"].startswith("cannot import 'modle.X'")
    assert "custom/ folder" in problem["hint"]


@pytest.mark.parametrize(
    ("argv", "exit_code", "error", "problems"),
    [
        pytest.param(["run", "bad"], 1, 'bad/meta.conf:1: min_clients: expected an integer, got "two"',
                     [BAD_META_PROBLEM], id="invalid-job"),
        pytest.param(["run", "missing"], 1, "missing: no such job folder", [
            {"file": "missing", "line": None, "key_path": "", "message": "no such job folder", "hint": None}
        ], id="missing-job"),
        pytest.param(["run", "job", "-n", "0"], 2, "-n: expected at least 1 client, got 0", None, id="no-clients"),
        pytest.param(["run"], 2, "flengine run: give a job folder (JOB), or --resume WORKSPACE", None, id="no-job"),
        pytest.param(["run", "job", "-n", "two"], 2, "flengine run: argument -n/--clients: invalid int value: 'two'",
                     None, id="bad-option"),
        pytest.param(["validate"], 2, "flengine validate: the following arguments are required: JOB", None,
                     id="validate-no-job"),
    ],
)  # fmt: skip
def test_errors_before_anything_runs_give_the_error_document(
    argv: list[str],
    exit_code: int,
    error: str,
    problems: list[dict[str, object]] | None,
    make_job: MakeJob,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make_job()
    make_job(BAD_META, name="bad")

    code = main([*argv, "--format", "json"])

    captured = capsys.readouterr()
    expected = {"error": error, "exit_code": exit_code}
    if problems is not None:
        expected["problems"] = problems
    assert code == exit_code
    assert json.loads(captured.out) == expected
    assert "Traceback" not in captured.err
    assert not Path("workspace").exists()  # nothing ran


@pytest.mark.parametrize(
    ("argv", "error_start"),
    [
        pytest.param(["admin", "nokit", "list"], "nokit/MANIFEST.json: cannot read the kit's manifest", id="admin"),
        pytest.param(["provision", "nofile.conf", "-o", "kits"], "nofile.conf: 1 problem; nothing was written",
                     id="provision"),
        pytest.param(["poc", "status", "-d", "nopoc"], "nopoc: not a prepared POC", id="poc"),
    ],
)  # fmt: skip
def test_the_other_json_commands_give_the_error_document_too(
    argv: list[str],
    error_start: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)

    code = main([*argv, "--format", "json"])

    document = json.loads(capsys.readouterr().out)
    assert code == 1
    assert document["exit_code"] == 1
    assert document["error"].startswith(error_start)


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [
        pytest.param(["run", "job"], False, id="none"),
        pytest.param(["-v", "run", "job"], True, id="before"),
        pytest.param(["run", "job", "-v"], True, id="after"),
        pytest.param(["run", "--verbose", "job"], True, id="after-long"),
        pytest.param(["validate", "job", "-v"], True, id="validate"),
        pytest.param(["server", "start", "kit", "-v"], True, id="server-start"),
        pytest.param(["admin", "kit", "list", "-v"], True, id="admin"),
        pytest.param(["poc", "status", "-v"], True, id="poc"),
        pytest.param(["provision", "p.conf", "-o", "kits", "-v"], True, id="provision"),
    ],
)
def test_verbose_is_accepted_before_and_after_the_command(argv: list[str], verbose: bool) -> None:
    args = _parser().parse_args(argv)

    assert args.verbose is verbose


def test_run_json_prints_the_summary_on_stdout_and_progress_on_stderr(tmp_path: Path) -> None:
    make_bench_job(tmp_path)

    result = run_flengine("run", "bench_job", "--format", "json", "--workspace", "ws", "-v", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["status"] == "FINISHED_COMPLETED"
    assert summary == json.loads((tmp_path / "ws" / "summary.json").read_text(encoding="utf-8"))
    assert f"job bench: 2 clients, workspace {tmp_path / 'ws'}" in result.stderr.splitlines()
    assert "FINISHED_COMPLETED in " in result.stderr  # the summary table
    assert " DEBUG " in (tmp_path / "ws" / "server" / "log.txt").read_text(encoding="utf-8")  # -v reached it


@pytest.mark.slow  # a second whole run; the JSON run above covers the path
def test_run_json_quiet_prints_the_summary_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    make_bench_job(tmp_path, num_rounds=1)

    code = main(["run", "bench_job", "--format", "json", "--quiet", "--workspace", "ws"])

    captured = capsys.readouterr()
    assert code == 0
    assert json.loads(captured.out)["status"] == "FINISHED_COMPLETED"
    assert captured.err == ""


@pytest.mark.slow  # a whole run; test_live_console covers the console itself
def test_run_quiet_in_text_prints_one_line_per_round_and_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    make_bench_job(tmp_path, num_rounds=2)

    code = main(["run", "bench_job", "--quiet", "--workspace", "ws"])

    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line.split(" done in ")[0] for line in lines if line.startswith("[round ")] == [
        "[round 1/2]",
        "[round 2/2]",
    ]
    assert "round  time (s)  metrics" in lines and any(line.startswith("FINISHED_COMPLETED in ") for line in lines)
