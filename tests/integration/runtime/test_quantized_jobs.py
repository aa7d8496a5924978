"""Quantized transfers in real jobs: FedAvg folding, FedAvg with download_to_disk, and Swarm.

The BENCHMARK.md update (site k adds ``k * 0.001``, weight ``k * 100``) on BenchNet, whose values
lie in (-0.05, 0.05) plus what the rounds add. Each transfer may err by the mode's bound relative
to the largest value of a block (int8) or of a tensor; the final model must be the analytic one
within the sum of those bounds over the transfers a value went through, and never exactly it
(it was really quantized).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.fobs.quantized import CODECS
from engine.runtime.states import JobState
from tests.integration.runtime.jobkit import expected_delta, make_bench_job, make_swarm_job
from tests.integration.runtime.test_download_to_disk import initial_model

ROUNDS = 2
LARGEST = 0.05 + ROUNDS * 0.01  # the largest magnitude a value reaches


def filters(kind: str, mode: str) -> str:
    return (
        f"{kind}_filters = [{{ tasks = [train], filters = [{{ path = engine.filters.Quantize, "
        f"args {{ mode = {mode} }} }}] }}]\n"
    )


def assert_quantized_analytic(final: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], delta: float,
                              mode: str, transfers: int) -> None:  # fmt: skip
    bound = transfers * CODECS[mode].max_relative_error * LARGEST * 1.001
    errors = [(final[name].double() - (tensor.double() + ROUNDS * delta)).abs().max().item()
              for name, tensor in initial.items()]  # fmt: skip
    assert max(errors) <= bound, (max(errors), bound)
    assert max(errors) > 0, "the model is exact: nothing was quantized"


@pytest.mark.parametrize(("mode", "to_disk"), [("int8", False), ("bf16", True)], ids=["int8-folding", "bf16-disk"])
def test_fedavg_with_quantized_models_reaches_the_analytic_model_within_the_bound(
    simulate, tmp_path: Path, mode: str, to_disk: bool
) -> None:
    job = make_bench_job(
        tmp_path,
        num_rounds=ROUNDS,
        layers=2,
        width=64,
        chunk_bytes=4096,
        workflow_args={"download_to_disk": to_disk},
        server_extra=filters("task_data", mode),
        client_extra=filters("task_result", mode),
    )
    initial = initial_model(job, 2, 64)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    # Per round: the global model to each client, and each client's result back.
    assert_quantized_analytic(final, initial, expected_delta(2), mode, transfers=2 * ROUNDS)


def test_swarm_with_quantized_models_and_download_to_disk(simulate, tmp_path: Path) -> None:
    job = make_swarm_job(
        tmp_path,
        num_rounds=ROUNDS,
        layers=2,
        width=64,
        controller_args={"quantize": "int8", "download_to_disk": True},
    )
    initial = initial_model(job, 2, 64)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    finals = [
        load_file(tmp_path / "workspace" / site / "models" / "global.safetensors")
        for site in ("site-1", "site-2", "site-3")
    ]
    for final in finals:  # the final model goes to the result clients exactly: all the same
        assert all(torch.equal(final[name], finals[0][name]) for name in final)
    assert_quantized_analytic(finals[0], initial, expected_delta(3), "int8", transfers=2 * ROUNDS)
