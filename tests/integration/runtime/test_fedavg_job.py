"""`flengine run` on real jobs: jobs/fedavg learns the digits, FedAvg on BenchNet is exact, the
config's chunk sizes take effect, and the summary records states, rounds and memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.examples.digits import Net, load_split
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("job_name", ["fedavg", "fedavg_sag"])
def test_fedavg_jobs_train_the_digits_model_to_90_percent(simulate, tmp_path: Path, job_name: str) -> None:
    result, output = simulate(REPO / "jobs" / job_name)

    assert result.state is JobState.FINISHED_COMPLETED, output
    summary = read_json(tmp_path / "workspace" / "summary.json")
    assert [s["state"] for s in summary["states"]] == ["SUBMITTED", "RUNNING", "FINISHED_COMPLETED"]
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]  # as the console counts
    assert all(set(r["metrics"]) == {"global_accuracy", "local_accuracy"} for r in summary["rounds"])
    assert set(summary["processes"]) == {"server", "site-1", "site-2"}
    assert all(p["peak_rss_mb"] > 50 and p["exit_code"] == 0 for p in summary["processes"].values())
    assert "[round 3/3] done" in output and "FINISHED_COMPLETED" in output
    weights = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    _, (val_x, val_y) = load_split(0, 2)
    net = Net(hidden=64)
    net.load_state_dict(weights)
    accuracy = (net(val_x).argmax(dim=1) == val_y).float().mean().item()
    assert accuracy >= 0.90


@pytest.mark.parametrize(
    ("execution_mode", "chunk_bytes"),
    [("in_process", 4096), ("subprocess", 0)],
    ids=["in-process-4KiB-chunks", "subprocess-inline"],
)
def test_fedavg_on_benchnet_ends_at_the_analytic_model(
    simulate, tmp_path: Path, execution_mode: str, chunk_bytes: int
) -> None:
    job = make_bench_job(
        tmp_path, num_rounds=2, layers=2, width=64, execution_mode=execution_mode, chunk_bytes=chunk_bytes
    )
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        initial = {name: t.detach().clone() for name, t in BenchNet(layers=2, width=64).state_dict().items()}

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    delta = 2 * expected_delta(2)
    for name, tensor in initial.items():
        expected = tensor.double() + delta
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name
    processes = {site: read_json(tmp_path / "workspace" / site / "process.json") for site in ("server", "site-1")}
    model_bytes = sum(t.numel() * 4 for t in initial.values())
    if chunk_bytes:  # every stream was pulled in chunks of the configured size
        assert processes["server"]["chunks_served"] >= 2 * 2 * model_bytes // chunk_bytes
        assert processes["site-1"]["chunks_served"] >= 2 * model_bytes // chunk_bytes
    else:  # 0: tensors went inline, nothing was streamed
        assert processes["server"]["chunks_served"] == 0
        assert processes["site-1"]["chunks_served"] == 0


@pytest.mark.parametrize(
    ("side", "reason"),
    [("client", "task data could not be received"), ("server", "result of site-1 for task 'train' refused")],
)
def test_the_per_request_timeout_of_the_config_bounds_each_chunk_request(
    simulate, tmp_path: Path, side: str, reason: str
) -> None:
    """A 64 MiB model in one chunk cannot arrive within 2 ms: the side whose config says so fails it."""
    timeout = "streaming_per_request_timeout = 0.002\nstreaming_retries = 0\n"  # no retry: the timeout is the end
    job = make_bench_job(
        tmp_path,
        num_rounds=1,
        layers=1,
        width=4096,
        chunk_bytes=128 << 20,
        client_extra=timeout if side == "client" else "",
        # the server sends inline, so only its pulls of the results are timed
        server_extra=timeout + "tensor_download_chunk_size = 0\n" if side == "server" else "",
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    summary = read_json(tmp_path / "workspace" / "summary.json")
    assert reason in summary["reason"] and "no reply within 0.002 s" in summary["reason"], summary["reason"]


def test_the_tensor_pool_setting_reaches_every_process_and_later_rounds_reuse_memory(simulate, tmp_path: Path) -> None:
    setting = "tensor_pool_idle_release_s = 120\n"
    # 512 x 512 float32 weights: 1 MiB each, the smallest tensors the pool takes.
    job = make_bench_job(tmp_path, num_rounds=4, layers=2, width=512, server_extra=setting, client_extra=setting)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    for site in ("server", "site-1", "site-2"):
        pool = read_json(tmp_path / "workspace" / site / "process.json")["tensor_pool"]
        assert pool["idle_release_s"] == 120, site
        # Later rounds land in memory of earlier ones: results and sums on the server; on the
        # clients the global model of round r + 2 in that of round r (the script still holds
        # round r's model while it receives round r + 1's, as scripts do).
        assert pool["allocated_bytes"] > 0 and pool["reused_bytes"] >= pool["allocated_bytes"], (site, pool)
