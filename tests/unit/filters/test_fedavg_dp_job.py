"""jobs/fedavg_dp under the simulator: the clients' updates go through GaussianPrivacy, and every
round of summary.json holds the epsilon that dp_accounting gives for that many rounds."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting import rdp

from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import processes_mentioning

REPO = Path(__file__).resolve().parents[3]


def epsilon_of(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    accountant = rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


def job_copy(tmp_path: Path) -> Path:
    return shutil.copytree(REPO / "jobs" / "fedavg_dp", tmp_path / "fedavg_dp")


def test_fedavg_dp_reports_the_epsilon_spent_each_round(tmp_path: Path) -> None:
    job = job_copy(tmp_path)
    # As a run resumed at round 2: the rounds before it count too, which only the round number
    # the result filter sees (not its own count of results) can tell.
    server = job / "app" / "config" / "config_fed_server.conf"
    server.write_text(
        server.read_text(encoding="utf-8").replace("num_rounds = 3", "num_rounds = 3\n      start_round = 1")
    )
    workspace = tmp_path / "workspace"

    result = run_simulation(job, None, workspace, out=io.StringIO())

    assert result.state is JobState.FINISHED_COMPLETED
    summary = json.loads((workspace / "summary.json").read_text(encoding="utf-8"))
    assert [entry["round"] for entry in summary["rounds"]] == [2, 3, 4]  # 1-based, as users see them
    reported = [entry["metrics"]["dp_epsilon"] for entry in summary["rounds"]]
    # jobs/fedavg_dp: noise_multiplier 0.05, both clients every round, delta 1e-5.
    assert reported == pytest.approx([epsilon_of(0.05, 1.0, r, 1e-5) for r in (2, 3, 4)], rel=1e-9)
    logs = "".join(p.read_text(encoding="utf-8", errors="replace") for p in workspace.rglob("*.txt"))
    assert "dp epsilon site=site-1 round=4 epsilon=" in logs and "dp epsilon site=site-2 round=2 epsilon=" in logs
    assert processes_mentioning(str(tmp_path)) == []
