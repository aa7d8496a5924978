"""A client holds one model with the plain benchmark loop: ``flare.send`` hands the tensors over.

The script is BENCHMARK.md's loop (``m = flare.receive()``, update ``m.params`` in place,
``flare.send(FLModel(params=m.params, ...))``, no ``del``) run by ``flengine run``'s simulator.
It records, with ``flare.log``, what reading the sent params after send raised, and how many of
the storages a round received were the ones of the round before: the previous round's tensors
were let go of before the next model arrived, and the tensor pool gave their memory back to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.runtime.states import JobState
from tests.integration.runtime.jobkit import make_bench_job

#: Two layers of 512 x 512 float32: each weight is 1 MiB, large enough for the tensor pool.
LAYERS, WIDTH = 2, 512
ROUNDS = 3

SCRIPT = """
import weakref

import torch

from engine import client as flare
from engine.client import ParamsHandedOverError
from engine.model import FLModel

POOLED_BYTES = 1 << 20
flare.init()
k = int(flare.get_site_name().rsplit("-", 1)[-1])
before = None
watched = None
while flare.is_running():
    m = flare.receive()
    if m is None:
        break
    storages = {t.untyped_storage().data_ptr() for t in m.params.values() if t.nbytes >= POOLED_BYTES}
    if before is not None:
        flare.log("reused_storages", len(storages & before))
        flare.log("sent_tensor_alive", watched() is not None)
    before = storages
    watched = weakref.ref(m.params["layers.0.weight"])
    with torch.no_grad():
        for t in m.params.values():
            t.add_(k * 0.001)
    sent = FLModel(params=m.params, meta={"NUM_STEPS_CURRENT_ROUND": k * 100})
    flare.send(sent)
    for name, model in (("sent", sent), ("received", m)):
        try:
            model.params["layers.0.weight"]
            flare.log(name + "_after_send", "readable")
        except ParamsHandedOverError as e:
            flare.log(name + "_after_send", type(e).__name__ + ": " + str(e))
"""


def _metrics(workspace: Path, site: str) -> dict[str, list]:
    """Each key the site's script logged -> its values, in order."""
    found: dict[str, list] = {}
    for path in workspace.rglob("metrics.jsonl"):
        if site not in path.parts:
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            found.setdefault(record["key"], []).append(record["value"])
    return found


@pytest.mark.parametrize("execution_mode", ["in_process", "subprocess"])
def test_the_benchmark_loop_hands_each_round_back_before_the_next(
    simulate, tmp_path: Path, execution_mode: str
) -> None:
    job = make_bench_job(
        tmp_path, num_rounds=ROUNDS, num_clients=1, layers=LAYERS, width=WIDTH, execution_mode=execution_mode
    )
    (job / "app" / "custom" / "bench_client.py").write_text(SCRIPT, encoding="utf-8")

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    metrics = _metrics(tmp_path / "workspace", "site-1")
    handed = (
        "ParamsHandedOverError: the params of this FLModel were handed to the engine by "
        "flare.send(..., clear_cache=True); keep a copy before send, or pass clear_cache=False"
    )
    assert metrics["sent_after_send"] == [handed] * ROUNDS
    assert metrics["received_after_send"] == [handed] * ROUNDS
    assert metrics["sent_tensor_alive"] == [False] * (ROUNDS - 1)
    # every 1 MiB weight of rounds 1 and 2 landed in the memory of the round before
    assert metrics["reused_storages"] == [LAYERS] * (ROUNDS - 1), output
