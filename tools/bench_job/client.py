"""The BENCHMARK.md client loop, as a user writes it: site k adds ``k * 0.001`` to every parameter
in place and reports ``NUM_STEPS_CURRENT_ROUND = k * 100`` (no ``del``: `flare.send` hands the
tensors over, so the previous round's model is not alive while the next one arrives)."""

from __future__ import annotations

import torch

from engine import client as flare
from engine.model import FLModel

flare.init()
k = int(flare.get_site_name().rsplit("-", 1)[-1])
while flare.is_running():
    model = flare.receive()
    if model is None:
        break
    with torch.no_grad():
        for tensor in model.params.values():
            tensor.add_(k * 0.001)
    flare.send(FLModel(params=model.params, meta={"NUM_STEPS_CURRENT_ROUND": k * 100}))
