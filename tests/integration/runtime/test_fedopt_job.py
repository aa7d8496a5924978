"""`flengine run` of a FedOpt job (FedAdam on BenchNet, downloads to disk): the final model is the
paper's Adam step from the BENCHMARK.md update, its state lived in a file, and the file is gone."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.runtime.states import JobState
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

ROUNDS = 3
LR, BETA1, BETA2, EPSILON = 0.01, 0.9, 0.99, 1e-3


def test_fedadam_with_state_on_disk_ends_at_the_papers_model(simulate, tmp_path: Path) -> None:
    fedopt = {"server_optimizer": "adam", "server_lr": LR, "download_to_disk": True}
    job = make_bench_job(tmp_path, num_rounds=ROUNDS, layers=2, width=64, chunk_bytes=4096, workflow_args=fedopt)
    server_conf = job / "app" / "config" / "config_fed_server.conf"
    server_conf.write_text(server_conf.read_text().replace("engine.workflows.FedAvg", "engine.workflows.FedOpt"))
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        initial = {name: t.detach().clone() for name, t in BenchNet(layers=2, width=64).state_dict().items()}

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    # Every weight moves by the same pseudo-gradient D each round: Adam's steps are scalars.
    d, m, v, moved = expected_delta(2), 0.0, 0.0, 0.0
    for _ in range(ROUNDS):
        m = BETA1 * m + (1 - BETA1) * d
        v = BETA2 * v + (1 - BETA2) * d * d
        moved += LR * m / (math.sqrt(v) + EPSILON)
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    for name, tensor in initial.items():
        assert torch.allclose(final[name].double(), tensor.double() + moved, rtol=0, atol=2e-6), name
    assert abs(moved - ROUNDS * d) > 1e-3  # not FedAvg's model
    server = tmp_path / "workspace" / "server"
    log = (server / "log.txt").read_text()
    assert "server optimizer state on disk" in log and "server optimizer state deleted" in log
    assert not list(server.rglob("fedopt_state-*"))
