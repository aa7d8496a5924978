"""One real run for the report tests: jobs/fedavg with 2 rounds, run once by the simulator."""

from __future__ import annotations

import io
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.runtime.simulator import SimulationResult, run_simulation

JOBS = Path(__file__).resolve().parents[3] / "jobs"
ROUNDS = 2


@dataclass
class FinishedRun:
    """A finished simulation: its result, its workspace and what it printed."""

    result: SimulationResult
    workspace: Path
    output: str


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """jobs/fedavg (2 clients) with ``num_rounds = 2``, run once for every report test (about 8 s)."""
    root = tmp_path_factory.mktemp("report-run")
    job = shutil.copytree(JOBS / "fedavg", root / "fedavg")
    config = job / "app" / "config" / "config_fed_server.conf"
    text = config.read_text(encoding="utf-8")
    assert "num_rounds = 3" in text
    config.write_text(text.replace("num_rounds = 3", f"num_rounds = {ROUNDS}"), encoding="utf-8")
    out = io.StringIO()
    result = run_simulation(job, workspace=root / "workspace", out=out)
    assert result.exit_code == 0, out.getvalue()
    return FinishedRun(result, result.workspace, out.getvalue())


@pytest.fixture
def workspace_copy(finished_run: FinishedRun, tmp_path: Path) -> Path:
    """A copy of the run's workspace that a test may damage."""
    return shutil.copytree(finished_run.workspace, tmp_path / "workspace")
