"""The simulator runs everything under CURVE with throw-away keys; turning it off is explicit and loud."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from engine.errors import UsageError
from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from engine.site import INSECURE_WARNING
from tests.integration.runtime.jobkit import make_bench_job


def logs(workspace: Path) -> dict[str, str]:
    return {site: (workspace / site / "log.txt").read_text(encoding="utf-8") for site in ("server", "site-1", "site-2")}


def test_a_run_is_curve_with_keys_made_for_it_and_removed_after(simulate, tmp_path: Path) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, layers=1, width=8, execution_mode="subprocess")

    result, output = simulate(job)

    workspace = tmp_path / "workspace"
    assert result.state is JobState.FINISHED_COMPLETED, output
    assert not (workspace / "keys").exists()
    assert "insecure" not in output
    for site, text in logs(workspace).items():
        assert f"cell started: fqcn={site} role=" in text and "security=none" not in text, site
    # The executor's local cell, which the subprocess training script connects to, is CURVE too.
    assert "fqcn=site-1 role=server endpoint=tcp://127.0.0.1" in logs(workspace)["site-1"]
    assert "security=curve" in logs(workspace)["site-1"].split("role=server", 1)[1].splitlines()[0]


def test_insecure_is_explicit_and_warned_about_at_every_start(simulate, tmp_path: Path) -> None:
    insecure = "cell { insecure = true }\n"
    job = make_bench_job(tmp_path, num_rounds=1, layers=1, width=8, server_extra=insecure, client_extra=insecure)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    assert INSECURE_WARNING in output
    for site, text in logs(tmp_path / "workspace").items():
        assert "security=none" in text and "insecure = true" in text, site


def test_a_job_whose_configs_disagree_on_insecure_is_refused_before_anything_starts(tmp_path: Path) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, layers=1, width=8, server_extra="cell { insecure = true }\n")

    with pytest.raises(UsageError, match=r"config_fed_server.conf: cell.insecure = true, but .*config_fed_client.conf"):
        run_simulation(job, workspace=tmp_path / "workspace", out=io.StringIO())

    assert not (tmp_path / "workspace").exists()
