"""A Swarm aggregation client folds results chunk by chunk; one failing midway is never in the mean (real processes).

site-3 sends a NaN in the last tensor of its result, late: the aggregation client has folded
site-2's result long before, and part of site-3's when the NaN comes. The round's sum is then
made again from site-1's and site-2's results alone, site-2's pulled once more: site-2 kept
serving it past its offer's timeout (2 s here) because the aggregation client said it might
need it again. The final model must be the mean of site-1 and site-2 (1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import expected_delta, make_swarm_job

#: The BENCHMARK.md update (site k adds k * 0.001, weight k * 100); ``--nan-site`` sleeps
#: ``--sleep-s`` first, then puts a NaN in the last tensor of its result (the stream's last).
SCRIPT = """
import argparse
import time
from engine import client as flare
from engine.model import FLModel

parser = argparse.ArgumentParser()
parser.add_argument("--nan-site", default="")
parser.add_argument("--sleep-s", type=float, default=0.0)
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
        time.sleep(args.sleep_s)
        params[list(params)[-1]].view(-1)[-1] = float("nan")
    flare.send(FLModel(params=params, meta={"NUM_STEPS_CURRENT_ROUND": k * 100}))
"""
SITES = ["site-1", "site-2", "site-3"]


# End to end; CI runs it with -m slow. The default run covers its paths: the taint and the rebuild
# (tests/unit/aggregators/test_folding.py), pulling again at a Swarm client (test_swarm_intake.py).
@pytest.mark.slow
def test_a_result_failing_midway_is_left_out_and_the_others_are_pulled_again(simulate, tmp_path: Path) -> None:
    job = make_swarm_job(
        tmp_path,
        num_rounds=1,
        layers=3,
        width=64,
        script_args="--nan-site site-3 --sleep-s 8",
        controller_args={"min_responses_required": 2, "wait_time_after_min_resps_received": 60},
    )
    (job / "app" / "custom" / "bench_client.py").write_text(SCRIPT)
    config = job / "app" / "config" / "config_fed_client.conf"  # offers time out 2 s after their last request
    config.write_text(
        config.read_text().replace("format_version = 2\n", "format_version = 2\nstreaming_per_request_timeout = 2\n")
    )
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        initial = {n: t.detach().clone() for n, t in BenchNet(layers=3, width=64).state_dict().items()}

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    workspace = tmp_path / "workspace"
    rounds = read_json(workspace / "summary.json")["rounds"]
    assert [r["clients"] for r in rounds] == [["site-1", "site-2"]]
    for site in SITES:  # every result client has the mean of site-1 and site-2 alone
        final = load_file(workspace / site / "models" / "global.safetensors")
        for name, tensor in initial.items():
            delta = expected_delta(3, [1, 2])
            assert torch.allclose(final[name].double(), tensor.double() + delta, rtol=0, atol=1e-6), (site, name)
    log = (workspace / "site-1" / "log.txt").read_text()  # site-1 aggregates round 1
    assert "holds NaN or infinite values" in log and "round sum tainted" in log, log[-3000:]
    assert "round sum rebuilt: round=1 failed_midway=['site-3'] left_out=[]" in log, log[-3000:]
    assert "round aggregated round=1 results=2 folded=2" in log
