"""Faults in real processes: a script that raises, a result of the wrong shape, a task timeout with
a late result, Ctrl-C (a client killed mid-round: tests/faults/test_dead_sites.py). Each asserts the job's final state and (through
the `simulate` fixture) that no process is left behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.runtime.states import JobState
from tests.integration.runtime.conftest import processes_mentioning, read_json
from tests.integration.runtime.jobkit import make_bench_job


@pytest.mark.parametrize(
    ("min_clients", "state"),
    [(1, JobState.FINISHED_COMPLETED), (2, JobState.FINISHED_EXECUTION_EXCEPTION)],
    ids=["min-met-round-goes-on", "min-missed-job-fails"],
)
def test_a_script_that_raises_fails_its_task(simulate, tmp_path: Path, min_clients: int, state: JobState) -> None:
    job = make_bench_job(
        tmp_path,
        min_clients=min_clients,
        script_args="--fault raise --fault-site site-2",
        workflow_args={"wait_time_after_min_received": 20.0},  # the task ends when site-2's error arrives
    )

    result, output = simulate(job)

    assert result.state is state, output
    summary = read_json(tmp_path / "workspace" / "summary.json")
    if state is JobState.FINISHED_COMPLETED:
        assert "injected failure on site-2" in summary["rounds"][0]["failed"]["site-2"]
        assert summary["rounds"][0]["clients"] == ["site-1"]
    else:
        assert "site-2" in summary["reason"] and "injected failure on site-2" in summary["reason"]
        assert summary["status"] == "FINISHED_EXECUTION_EXCEPTION"


def test_a_result_of_the_wrong_shape_is_refused_before_aggregation(simulate, tmp_path: Path) -> None:
    job = make_bench_job(
        tmp_path,
        num_rounds=1,
        min_clients=1,
        script_args="--fault bad_shape --fault-site site-2",
        workflow_args={"wait_time_after_min_received": 20.0},
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    failed = read_json(tmp_path / "workspace" / "summary.json")["rounds"][0]["failed"]
    assert "site-2" in failed["site-2"] and "shape" in failed["site-2"]


def test_a_task_timeout_ends_the_round_and_the_late_result_is_ignored(simulate, tmp_path: Path) -> None:
    job = make_bench_job(
        tmp_path,
        num_rounds=2,
        min_clients=1,
        script_args="--fault sleep --fault-site site-2 --sleep-s 4",
        workflow_args={"train_timeout": 3.0, "wait_time_after_min_received": 30.0},
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    summary = read_json(tmp_path / "workspace" / "summary.json")
    assert summary["rounds"][0]["clients"] == ["site-1"]
    assert summary["rounds"][0]["failed"]["site-2"].startswith("TIMEOUT")
    assert summary["rounds"][1]["clients"] == ["site-1", "site-2"]
    server_log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    assert "result of site-2 for task 'train' not taken: LATE" in server_log  # and never pulled


def test_ctrl_c_stops_every_process_and_records_aborted(tmp_path: Path) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, script_args="--fault sleep --fault-site site-1 --sleep-s 600")
    workspace = tmp_path / "workspace"
    run = subprocess.Popen(
        [sys.executable, "-m", "engine", "run", str(job), "--workspace", str(workspace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As from a terminal: a test run started in the background inherits SIGINT ignored,
        # and Python then installs no KeyboardInterrupt for it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (workspace / "site-1" / "log.txt").exists():
        time.sleep(0.2)
    time.sleep(3)

    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=60)

    assert run.returncode == 130, output
    assert read_json(workspace / "summary.json")["status"] == "FINISHED_ABORTED"
    assert processes_mentioning(str(tmp_path)) == []
