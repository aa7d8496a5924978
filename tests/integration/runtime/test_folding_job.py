"""FedAvg in memory mode folds each result into the sum tensor by tensor as it arrives (real processes).

The final model must be the weighted mean computed apart (BENCHMARK.md's update, 1e-6), every
result must have been folded from its stream, and a result that fails after some of its tensors
were folded (a NaN in its last tensor) must leave no trace: a round that needs every result
fails with that site's reason and no model is made from the sum; a round that needs fewer takes
results whole, refuses that one and averages the others.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

#: The BENCHMARK.md update (site k adds k * 0.001, weight k * 100); ``--nan-site`` puts a NaN
#: in the last tensor of that site's result (the stream's last: the others are folded first).
SCRIPT = """
import argparse
from engine import client as flare
from engine.model import FLModel

parser = argparse.ArgumentParser()
parser.add_argument("--nan-site", default="")
args = parser.parse_args()
flare.init()
site = flare.get_site_name()
k = int(site.rsplit("-", 1)[-1])
while flare.is_running():
    model = flare.receive()
    if model is None:
        break
    params = {name: tensor + k * 0.001 for name, tensor in model.params.items()}
    if site == args.nan_site:
        params[list(params)[-1]].view(-1)[0] = float("nan")
    flare.send(FLModel(params=params, meta={"NUM_STEPS_CURRENT_ROUND": k * 100}, metrics={"k": float(k)}))
"""


def _job(tmp_path: Path, **kw) -> tuple[Path, dict[str, torch.Tensor]]:
    job = make_bench_job(tmp_path, layers=3, width=64, chunk_bytes=4096, **kw)
    (job / "app" / "custom" / "bench_client.py").write_text(SCRIPT)
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        initial = {n: t.detach().clone() for n, t in BenchNet(layers=3, width=64).state_dict().items()}
    return job, initial


def _check_model(workspace: Path, initial: dict[str, torch.Tensor], delta: float) -> None:
    final = load_file(workspace / "server" / "models" / "global.safetensors")
    assert final.keys() == initial.keys()
    for name, tensor in initial.items():
        assert torch.allclose(final[name].double(), tensor.double() + delta, rtol=0, atol=1e-6), name


def test_results_are_folded_as_they_arrive_and_the_model_is_exact(simulate, tmp_path: Path) -> None:
    job, initial = _job(tmp_path, num_rounds=2, num_clients=3)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    _check_model(tmp_path / "workspace", initial, 2 * expected_delta(3))
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    folded = [line for line in log.splitlines() if "result folded:" in line and "streamed=True" in line]
    assert len(folded) == 2 * 3, log[-3000:]  # every result of every round, from its stream
    summary = read_json(tmp_path / "workspace" / "summary.json")
    metrics = summary["rounds"][-1]["metrics"]
    assert abs(metrics["k"] - (1 * 100 + 2 * 200 + 3 * 300) / 600) < 1e-9


def test_a_result_failing_after_some_tensors_were_folded_fails_the_round_without_a_model(
    simulate, tmp_path: Path
) -> None:
    job, initial = _job(tmp_path, num_rounds=1, num_clients=3, script_args="--nan-site site-3")

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    assert "site-3" in result.summary["reason"] and "NaN" in result.summary["reason"], result.summary["reason"]
    _check_model(tmp_path / "workspace", initial, 0.0)  # the starting model: nothing was made from the sum
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    assert [line for line in log.splitlines() if "result folded:" in line and "streamed=True" in line], log[-3000:]


def test_a_round_that_needs_fewer_results_takes_them_whole_and_refuses_the_liar(simulate, tmp_path: Path) -> None:
    job, initial = _job(
        tmp_path,
        num_rounds=1,
        num_clients=3,
        min_clients=2,
        script_args="--nan-site site-3",
        workflow_args={"wait_time_after_min_received": 20.0},
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    _check_model(tmp_path / "workspace", initial, expected_delta(3, sites=[1, 2]))
    first = read_json(tmp_path / "workspace" / "summary.json")["rounds"][0]
    assert first["clients"] == ["site-1", "site-2"]
    assert "holds NaN or infinite values" in first["refused"]["site-3"]
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    assert not [line for line in log.splitlines() if "result folded:" in line and "streamed=True" in line]
