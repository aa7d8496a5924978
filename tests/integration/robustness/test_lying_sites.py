"""Sites that hold valid keys and lie: real client processes run `tools/liars/liar_train.py`.

The honest job must end FINISHED_COMPLETED with exactly the model it has without the liars
(their results are refused), the refusals counted in the summary and shown on the console, and
nothing a liar wrote reaching the console unchecked.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tools.bench_robust import accuracy_of
from tools.liars.job import make_liar_job

ROUNDS = 2


def _run(job: Path, workspace: Path, n_clients: int) -> tuple[dict, str, dict[str, torch.Tensor]]:
    out = io.StringIO()
    result = run_simulation(job, n_clients, workspace, out=out)
    assert result.state is JobState.FINISHED_COMPLETED, out.getvalue()
    model = load_file(workspace / "server" / "models" / "global.safetensors")
    return read_json(workspace / "summary.json"), out.getvalue(), model


def test_refused_liars_leave_exactly_the_honest_model(tmp_path: Path) -> None:
    liars = {"site-3": "nan", "site-4": "diff", "site-5": "steps"}
    lied = make_liar_job(tmp_path / "lied", num_clients=5, liars=liars, num_rounds=ROUNDS)
    honest = make_liar_job(tmp_path / "honest", num_clients=5, liars={}, num_rounds=ROUNDS, min_clients=2)

    summary, output, model = _run(lied, tmp_path / "ws-lied", 5)
    _, _, honest_model = _run(honest, tmp_path / "ws-honest", 2)  # site-1 and site-2 alone

    # The same up to the order the two honest results arrived in, which differs between any two
    # runs (weighted sums round differently in another order: one float32 ulp, ~1e-8 here).
    assert model.keys() == honest_model.keys()
    assert all(torch.allclose(model[name], honest_model[name], rtol=1e-6, atol=1e-7) for name in model)
    assert summary["refused"] == {"site-3": ROUNDS, "site-4": ROUNDS, "site-5": ROUNDS}
    first = summary["rounds"][0]
    assert first["clients"] == ["site-1", "site-2"]
    assert "holds NaN or infinite values" in first["refused"]["site-3"]
    assert "has DIFF params, this workflow expects FULL" in first["refused"]["site-4"]
    assert "above the aggregator's max_local_steps" in first["refused"]["site-5"]
    assert f"[round {ROUNDS}/{ROUNDS}] done" in output and "refused: site-3, site-4, site-5" in output
    assert "results refused (see each round's 'refused' in summary.json): site-3 x2, site-4 x2, site-5 x2" in output


def test_lying_metrics_are_dropped_and_never_reach_the_console(tmp_path: Path) -> None:
    job = make_liar_job(tmp_path / "job", num_clients=3, liars={"site-3": "metrics"}, num_rounds=ROUNDS)

    summary, output, _ = _run(job, tmp_path / "ws", 3)

    assert summary["refused"] == {}  # its weights are honest and count; its metrics do not
    for entry in summary["rounds"]:
        assert entry["clients"] == ["site-1", "site-2", "site-3"]
        assert set(entry["metrics"]) == {"global_accuracy", "local_accuracy"}
        assert all(0 <= value <= 1 for value in entry["metrics"].values())
    assert "\x1b" not in output
    server_log = (tmp_path / "ws" / "server" / "log.txt").read_text(encoding="utf-8")
    assert "metric refused: contributor=site-3 round=1 metric='global_accuracy'" in server_log
    assert "\x1b" not in server_log


@pytest.mark.parametrize(
    "aggregator",
    [
        {"path": "engine.aggregators.TrimmedMeanAggregator", "args": {"trim_fraction": 0.2}},
        pytest.param(
            {"path": "engine.aggregators.KrumAggregator", "args": {"num_byzantine": 1, "num_selected": 3}},
            marks=pytest.mark.slow,  # 20 s; the trimmed mean covers the path in the default run
        ),
    ],
    ids=["trimmed-mean", "multi-krum"],
)
def test_a_robust_aggregator_keeps_learning_despite_a_site_that_flips_its_updates(
    tmp_path: Path, aggregator: dict
) -> None:
    # The stated bound: in this setting (tools/bench_robust.py, docs/performance.md) five honest
    # sites reach 0.81 after 6 rounds with FedAvg, and FedAvg with this liar ends at 0.11; a
    # robust aggregator must stay above 0.7 with it.
    job = make_liar_job(
        tmp_path / "job", num_clients=5, liars={"site-5": "flip"}, num_rounds=6, min_clients=4, aggregator=aggregator
    )

    summary, _, _ = _run(job, tmp_path / "ws", 5)

    assert summary["refused"] == {}  # a flipped update is finite and well-formed: only the aggregator can stop it
    assert accuracy_of(tmp_path / "ws" / "server" / "models" / "global.safetensors") > 0.7
    if "Krum" in aggregator["path"]:
        server_log = (tmp_path / "ws" / "server" / "log.txt").read_text(encoding="utf-8")
        selections = [line for line in server_log.splitlines() if "krum selection" in line]
        assert len(selections) == 6 and not any("site-5" in line.split("scores=")[0] for line in selections)


def test_a_huge_key_metric_cannot_steer_the_round_without_declared_ranges(tmp_path: Path) -> None:
    # No metric_ranges at all: the defaults bound accuracies to [0, 1], so the liar's 1e9 is dropped
    # and the round's global_accuracy (and best_global) is the honest sites' mean.
    job = make_liar_job(
        tmp_path / "job",
        num_clients=3,
        liars={"site-3": "metrics"},
        num_rounds=ROUNDS,
        workflow_args={"metric_ranges": {}},
    )

    summary, _, _ = _run(job, tmp_path / "ws", 3)

    for entry in summary["rounds"]:
        assert 0 <= entry["metrics"]["global_accuracy"] <= 1
    server_log = (tmp_path / "ws" / "server" / "log.txt").read_text(encoding="utf-8")
    assert "metric refused: contributor=site-3 round=1 metric='global_accuracy'" in server_log
    assert "is outside the default range [0, 1]" in server_log
    assert (tmp_path / "ws" / "server" / "models" / "best_global.safetensors").exists()
