"""A server killed mid-job (SIGKILL) and the run resumed with ``flengine run --resume``: the job
goes on from its last completed round and ends at the model of a run that never stopped; a
damaged checkpoint ends the resume with one line naming the file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.fault_points import FAULT_POINT_ENV
from engine.runtime.simulator import resume_simulation
from engine.runtime.states import JobState
from tests.faults.conftest import events_of, first_after
from tests.integration.runtime.conftest import processes_mentioning, read_json
from tests.integration.runtime.jobkit import expected_delta, in_background, make_bench_job, make_swarm_job, pids_of

ROUNDS, WIDTH = 5, 16


def _job(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    # Round 3 (0-based 2) waits for site-1 for 3 s: the server is killed while it waits.
    job = make_bench_job(
        tmp_path,
        num_rounds=ROUNDS,
        width=WIDTH,
        script_args="--fault sleep --fault-site site-1 --fault-round 2 --sleep-s 3",
    )
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        initial = {name: t.detach().clone() for name, t in BenchNet(layers=2, width=WIDTH).state_dict().items()}
    return job, initial


def _assert_exact(workspace: Path, initial: dict[str, torch.Tensor]) -> None:
    final = load_file(workspace / "server" / "models" / "global.safetensors")
    for name, tensor in initial.items():
        expected = tensor.double() + ROUNDS * expected_delta(2)
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name


def _round_started(workspace: Path, shown_round: int) -> None:
    """Return once round ``shown_round`` (1-based) has begun and its checkpoint is written (the clients train on it)."""
    record = workspace / "server" / "checkpoint" / "fedavg" / "state.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if json.loads(record.read_text())["next_round"] == shown_round - 1:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)
    raise AssertionError(f"round {shown_round} never started")


def test_a_server_killed_mid_round_resumes_from_its_last_round_and_ends_exact(
    simulate, tmp_path: Path, fault_figures
) -> None:
    job, initial = _job(tmp_path)
    workspace = tmp_path / "workspace"
    running = in_background(simulate, job)
    _round_started(workspace, 3)
    (server,) = pids_of(str(tmp_path), "entry server")
    os.kill(server, signal.SIGKILL)  # mid-round: the clients are training on round 3
    crashed, _ = running()
    assert crashed.state is JobState.FINISHED_EXECUTION_EXCEPTION
    state = read_json(workspace / "server" / "checkpoint" / "fedavg" / "state.json")
    assert state["next_round"] == 2  # round 3 (0-based 2) was being played

    resumed_at = time.time()
    result = resume_simulation(workspace, out=open(os.devnull, "w"))

    assert result.state is JobState.FINISHED_COMPLETED, result.summary.get("reason")
    _assert_exact(workspace, initial)
    replayed = first_after(events_of(workspace / "server" / "events.jsonl"), "round_done", resumed_at)
    fault_figures.record(
        "simulator: the server job process SIGKILLed mid-round; `flengine run --resume`",
        "the run ends (no result); resumed, it plays the round in progress again from its checkpoint; "
        "FINISHED_COMPLETED",
        recover_s=replayed["at"] - resumed_at,
        rounds_lost=1,
        exact=True,
    )
    summary = read_json(workspace / "summary.json")
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3, 4, 5]  # the rounds before the crash too
    leftovers = sorted(p.name for p in (workspace / "server" / "checkpoint" / "fedavg").iterdir())
    assert leftovers == [f"model-{ROUNDS}.safetensors", "state.json"]  # no temp file, no older round
    assert not any(workspace.rglob("*.tmp")) and not (workspace / "keys").exists()
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow
def test_a_killed_run_resumes_with_the_command_line(tmp_path: Path, fault_figures) -> None:
    job, initial = _job(tmp_path)
    workspace = tmp_path / "workspace"
    command = [sys.executable, "-m", "engine", "run", str(job), "--workspace", str(workspace), "-q"]
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _round_started(workspace, 3)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the machine went down: every process of the run at once
        run.wait(30)
    for pid in pids_of(str(tmp_path)):
        os.kill(pid, signal.SIGKILL)

    resumed_at = time.time()
    resumed = subprocess.run(
        [sys.executable, "-m", "engine", "run", "--resume", str(workspace), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "(resumed from its last completed round)" in resumed.stdout
    _assert_exact(workspace, initial)
    assert processes_mentioning(str(tmp_path)) == []
    replayed = first_after(events_of(workspace / "server" / "events.jsonl"), "round_done", resumed_at)
    fault_figures.record(
        "simulator: every process of the run SIGKILLed mid-round (a host crash); `flengine run --resume`",
        "resumed from the last completed round, the same clients and sampling; FINISHED_COMPLETED",
        recover_s=replayed["at"] - resumed_at,
        rounds_lost=1,
        exact=True,
    )


@pytest.mark.slow  # end to end; CI runs it with -m slow
def test_a_truncated_checkpoint_ends_the_resume_with_one_line_naming_the_file(
    simulate, tmp_path: Path, fault_figures
) -> None:
    job, _ = _job(tmp_path)
    workspace = tmp_path / "workspace"
    running = in_background(simulate, job)
    _round_started(workspace, 3)
    (server,) = pids_of(str(tmp_path), "entry server")
    os.kill(server, signal.SIGKILL)
    running()
    model = workspace / "server" / "checkpoint" / "fedavg" / "model-2.safetensors"
    model.write_bytes(model.read_bytes()[:1000])

    result = resume_simulation(workspace, out=open(os.devnull, "w"))

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION
    reason = result.summary["reason"]
    assert f"{model}: 1000 bytes, the checkpoint recorded" in reason and "(truncated?)" in reason
    assert "\n" not in reason
    assert processes_mentioning(str(tmp_path)) == []
    fault_figures.record(
        "simulator: the checkpoint's model file truncated before `--resume`",
        "FINISHED_EXECUTION_EXCEPTION with one line naming the file and its recorded size; nothing else touched",
    )


def test_a_swarm_that_cannot_resume_ends_aborted_with_the_reason(
    simulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault_figures
) -> None:
    job = make_swarm_job(tmp_path, num_rounds=2, width=8)
    workspace = tmp_path / "workspace"
    monkeypatch.setenv(FAULT_POINT_ENV, "server/workflow_started")  # the server dies as the swarm begins
    crashed, output = simulate(job)
    assert crashed.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    monkeypatch.delenv(FAULT_POINT_ENV)

    result = resume_simulation(workspace, out=open(os.devnull, "w"))

    assert result.state is JobState.FINISHED_ABORTED
    assert result.summary["reason"] == (
        "workflow 'swarm' (SwarmServerController) was running when the server stopped and cannot resume; "
        "submit the job again to start over"
    )
    assert processes_mentioning(str(tmp_path)) == []
    fault_figures.record(
        "simulator: the server SIGKILLed during a Swarm job; `--resume`",
        "FINISHED_ABORTED at once with the reason (Swarm cannot resume), never a hang",
    )
