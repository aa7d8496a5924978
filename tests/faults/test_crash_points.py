"""Crashes at the worst moments, each at a precise point (`engine.fault_points`, SIGKILL): the
server mid-download, mid-aggregation and mid-checkpoint write, then ``--resume``; a client as
its result is pulled. Each job ends at the exact model, with nothing left behind."""

from __future__ import annotations

import os
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
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

ROUNDS, WIDTH = 4, 16


def _initial(job: Path) -> dict[str, torch.Tensor]:
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        return {name: t.detach().clone() for name, t in BenchNet(layers=2, width=WIDTH).state_dict().items()}


def _final(workspace: Path) -> dict[str, torch.Tensor]:
    return load_file(workspace / "server" / "models" / "global.safetensors")


def _no_leftovers(workspace: Path, tmp_path: Path) -> None:
    assert not any(workspace.rglob("*.tmp")), list(workspace.rglob("*.tmp"))
    assert not any(workspace.rglob("xfer-*")) and not (workspace / "keys").exists()
    checkpoint = workspace / "server" / "checkpoint" / "fedavg"
    assert sorted(p.name for p in checkpoint.iterdir()) == [f"model-{ROUNDS}.safetensors", "state.json"]
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.parametrize(
    ("point", "what"),
    [
        pytest.param("server/chunk_served@5", "mid-download (a chunk of round 3's model sent)", marks=pytest.mark.slow),
        pytest.param(
            "server/result_aggregated@5", "mid-aggregation (round 3's first result in the sum)", marks=pytest.mark.slow
        ),
        ("server/checkpoint_write@3", "mid-checkpoint write (round 3's record written, not yet renamed)"),
    ],
    ids=["mid-download", "mid-aggregation", "mid-checkpoint"],
)
def test_a_server_killed_at_the_worst_moment_resumes_exactly(
    simulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault_figures, point: str, what: str
) -> None:
    job = make_bench_job(tmp_path, num_rounds=ROUNDS, width=WIDTH)
    initial, workspace = _initial(job), tmp_path / "workspace"
    monkeypatch.setenv(FAULT_POINT_ENV, point)

    crashed, output = simulate(job)

    assert crashed.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    assert "the server process exited (code -9) without a result" in crashed.summary["reason"]
    monkeypatch.delenv(FAULT_POINT_ENV)
    resumed_at = time.time()
    result = resume_simulation(workspace, out=open(os.devnull, "w"))

    assert result.state is JobState.FINISHED_COMPLETED, result.summary.get("reason")
    final = _final(workspace)
    for name, tensor in initial.items():
        expected = tensor.double() + ROUNDS * expected_delta(2)
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name
    assert [r["round"] for r in read_json(workspace / "summary.json")["rounds"]] == list(range(1, ROUNDS + 1))
    _no_leftovers(workspace, tmp_path)
    replayed = first_after(events_of(workspace / "server" / "events.jsonl"), "round_done", resumed_at)
    fault_figures.record(
        f"simulator: the server SIGKILLed {what}; `--resume`",
        "resumed from the last completed round; FINISHED_COMPLETED",
        recover_s=replayed["at"] - resumed_at,
        rounds_lost=1,
        exact=True,
    )


@pytest.mark.slow
def test_a_client_killed_while_its_result_is_pulled_leaves_the_round_to_the_others(
    simulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault_figures
) -> None:
    job = make_bench_job(tmp_path, num_rounds=ROUNDS, num_clients=3, min_clients=2, width=WIDTH)
    initial, workspace = _initial(job), tmp_path / "workspace"
    monkeypatch.setenv(FAULT_POINT_ENV, "site-2/chunk_served@2")  # as the server pulls its first result

    result, output = simulate(job, 3)

    assert result.state is JobState.FINISHED_COMPLETED, output
    summary = read_json(workspace / "summary.json")
    assert [e["site"] for e in summary["site_events"]] == ["site-2"]
    assert all("site-2" not in r["clients"] for r in summary["rounds"][1:])  # never again after round 1
    delta = sum(expected_delta(3, [int(site[-1]) for site in r["clients"]]) for r in summary["rounds"])
    final = _final(workspace)
    for name, tensor in initial.items():
        assert torch.allclose(final[name].double(), tensor.double() + delta, rtol=0, atol=1e-6), name
    assert not any(workspace.rglob("*.tmp")) and processes_mentioning(str(tmp_path)) == []
    death = summary["site_events"][0]
    next_round = first_after(events_of(workspace / "server" / "events.jsonl"), "round_done", death["at"])
    fault_figures.record(
        "simulator: a client SIGKILLed as the server pulls its result (3 sites, min_clients 2)",
        "what was folded of it is taken out of the sum (rebuilt from the others, or the round played again); "
        "FINISHED_COMPLETED",
        recover_s=next_round["at"] - death["at"],
        rounds_lost=0,
        exact=True,
    )
