"""``flare.receive(into=net)`` in a real job: the global model lands in the script's own network.

The script builds BenchNet with other weights than the server's, receives every round into it,
and records with ``flare.log``: whether the network's tensors (and the received params) kept
their memory, whether the received weights are the expected global model, and how many bytes
of tensors the process's tensor pool handed out meanwhile. None means the chunks went straight
into the network: nothing was received into new memory and copied. In ``in_process`` mode the
pool is the client job's own (it pulls the task from the server); in ``subprocess`` mode the
script's (it pulls the task from its executor).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.runtime.states import JobState
from tests.integration.runtime.jobkit import make_bench_job
from tests.integration.runtime.test_client_memory import _metrics

#: Two layers of 512 x 512 float32: each weight is 1 MiB, large enough for the tensor pool.
LAYERS, WIDTH = 2, 512
ROUNDS = 3

SCRIPT = f"""
import torch

from benchnet_model import BenchNet
from engine import client as flare
from engine.fobs.tensor_pool import TENSOR_POOL
from engine.model import FLModel

flare.init()
k = int(flare.get_site_name().rsplit("-", 1)[-1])
net = BenchNet(layers={LAYERS}, width={WIDTH}, seed=7)  # not the server's weights
pointers = {{name: t.data_ptr() for name, t in net.state_dict().items()}}
expected = {{name: t.clone() for name, t in BenchNet(layers={LAYERS}, width={WIDTH}, seed=0).state_dict().items()}}


def pooled_bytes():
    stats = TENSOR_POOL.stats()
    return stats["allocated_bytes"] + stats["reused_bytes"]


while flare.is_running():
    before = pooled_bytes()
    m = flare.receive(into=net)
    if m is None:
        break
    flare.log("pooled_bytes", pooled_bytes() - before)
    state = net.state_dict()
    flare.log("same_memory", all(
        state[name].data_ptr() == m.params[name].data_ptr() == pointer for name, pointer in pointers.items()
    ))
    flare.log("max_error", max((state[name].double() - expected[name].double()).abs().max().item() for name in state))
    with torch.no_grad():
        for t in net.parameters():
            t.add_(k * 0.001)
    expected = {{name: t + k * 0.001 for name, t in expected.items()}}
    flare.send(FLModel(params=net.state_dict(), meta={{"NUM_STEPS_CURRENT_ROUND": k * 100}}))
"""


@pytest.mark.parametrize("execution_mode", ["in_process", "subprocess"])
def test_each_round_lands_in_the_scripts_own_network(simulate, tmp_path: Path, execution_mode: str) -> None:
    job = make_bench_job(
        tmp_path, num_rounds=ROUNDS, num_clients=1, layers=LAYERS, width=WIDTH, execution_mode=execution_mode
    )
    (job / "app" / "custom" / "bench_client.py").write_text(SCRIPT, encoding="utf-8")

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    metrics = _metrics(tmp_path / "workspace", "site-1")
    assert metrics["same_memory"] == [True] * ROUNDS
    assert metrics["max_error"][0] == 0.0  # round 1: the server's initial model, bit for bit
    assert max(metrics["max_error"]) <= 1e-6  # later: the mean of one client's update
    assert metrics["pooled_bytes"] == [0] * ROUNDS, output
