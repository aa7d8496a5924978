"""FedAvg in memory mode folds each result into the sum tensor by tensor as it arrives (real processes).

The final model must be the weighted mean computed apart (BENCHMARK.md's update, 1e-6), every
result must have been folded from its stream, and a result that fails after some of its tensors
were folded (a NaN in its last tensor, a client killed mid-upload) must leave no trace: the sum is
rebuilt from the other results, pulled once more, and the round's model is the one without that
client; a round that needed that result fails with the site's reason and makes no model.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import expected_delta, in_background, make_bench_job, pids_of

#: The BENCHMARK.md update (site k adds k * 0.001, weight k * 100); ``--nan-site`` puts a NaN
#: in the last tensor of that site's result (the stream's last: the others are folded first).
SCRIPT = """
import argparse
import sys
import time
from engine import client as flare
from engine.model import FLModel

parser = argparse.ArgumentParser()
parser.add_argument("--nan-site", default="")
parser.add_argument("--slow-site", default="")
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
    if site == args.slow_site:  # hold the GIL in long slices: this process serves its result slowly
        sys.setswitchinterval(0.05)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pass
"""


def _job(tmp_path: Path, width: int = 64, **kw) -> tuple[Path, dict[str, torch.Tensor]]:
    job = make_bench_job(tmp_path, layers=3, width=width, chunk_bytes=4096, **kw)
    (job / "app" / "custom" / "bench_client.py").write_text(SCRIPT)
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        initial = {n: t.detach().clone() for n, t in BenchNet(layers=3, width=width).state_dict().items()}
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


def test_a_round_that_needed_a_result_failing_midway_fails_without_a_model(simulate, tmp_path: Path) -> None:
    job, initial = _job(tmp_path, num_rounds=1, num_clients=3, script_args="--nan-site site-3")

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    assert "site-3" in result.summary["reason"] and "NaN" in result.summary["reason"], result.summary["reason"]
    _check_model(tmp_path / "workspace", initial, 0.0)  # the starting model: nothing was made from the sum
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    assert "round sum tainted: contributor=site-3" in log, log[-3000:]
    assert "rebuilding" not in log  # two results cannot make the round: not pulled again for nothing


def test_a_result_failing_midway_is_left_out_and_the_sum_rebuilt_exactly(simulate, tmp_path: Path) -> None:
    job, initial = _job(
        tmp_path,
        num_rounds=3,
        num_clients=3,
        min_clients=2,
        script_args="--nan-site site-3",
        workflow_args={"wait_time_after_min_received": 20.0},
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    _check_model(tmp_path / "workspace", initial, 3 * expected_delta(3, sites=[1, 2]))
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert [r["clients"] for r in rounds] == [["site-1", "site-2"]] * 3
    assert all("holds NaN or infinite values" in r["refused"]["site-3"] for r in rounds)
    assert abs(rounds[-1]["metrics"]["k"] - (100 + 2 * 200) / 300) < 1e-9  # site-3's metrics left out too
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    # Round 1: site-3's NaN comes after some of its tensors were folded: the sum is rebuilt.
    # Rounds 2 and 3: site-3 is received whole (one at a time, in the memory slot), refused
    # before anything of it is added: no rebuild.
    assert log.count("round sum tainted: contributor=site-3") == 1, log[-3000:]
    assert log.count("sum rebuilt without partly folded results: failed=['site-3'] left_out=[]") == 1
    assert "rebuilding the round's sum without partly folded results: failed=['site-3'] results=2" in log


def test_a_client_killed_mid_upload_is_left_out_and_the_model_is_exact(simulate, tmp_path: Path) -> None:
    job, initial = _job(
        tmp_path,
        num_rounds=1,
        num_clients=3,
        min_clients=2,
        width=512,  # 768 chunks of 4 KiB: seconds to serve while its script holds the GIL
        script_args="--slow-site site-3",
        workflow_args={"wait_time_after_min_received": 60.0},
        server_extra="streaming_max_requests_in_flight = 1\n",
    )
    events = tmp_path / "workspace" / "server" / "events.jsonl"
    finished = in_background(simulate, job)

    killed = _kill_once_uploading(events, "site-3", str(tmp_path), "--site site-3")
    result, output = finished()

    assert killed, output
    assert result.state is JobState.FINISHED_COMPLETED, output
    _check_model(tmp_path / "workspace", initial, expected_delta(3, sites=[1, 2]))
    [round_done] = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert round_done["clients"] == ["site-1", "site-2"] and "site-3" in round_done["failed"]
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    assert "round sum tainted: contributor=site-3" in log, log[-3000:]  # it died while being folded
    assert "sum rebuilt without partly folded results: failed=['site-3'] left_out=[]" in log


def _kill_once_uploading(events: Path, site: str, *words: str, timeout_s: float = 60.0) -> bool:
    """SIGKILL the processes named by ``words`` shortly after the server starts pulling ``site``'s result."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = events.read_text(encoding="utf-8", errors="replace") if events.exists() else ""
        if any('"result_uploading"' in line and f'"{site}"' in line for line in text.splitlines()):
            time.sleep(0.5)  # some of its chunks are folded by now, far from all
            for pid in pids_of(*words):
                os.kill(pid, signal.SIGKILL)
            return True
        time.sleep(0.01)
    return False
