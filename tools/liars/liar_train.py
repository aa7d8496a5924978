"""A digits training script that lies: the example's (``engine.examples.train``), with what it sends corrupted.

Only for tests and `tools/bench_robust.py` (a site that holds a valid key and lies); the job
generator in `tools/liars/job.py` deploys it to every site. It runs the example's script itself,
with the Client API's ``receive`` and ``send`` wrapped: the weights it received are kept, and
each trained result is changed by ``--attack`` before it goes out. ``--num-shards K`` deals the
data into K shards whatever the number of sites (``get_num_sites`` answers K), so that a run
with fewer sites trains the honest ones on the same data as a run with more.

- ``none``: honest (the same as the example's script);
- ``scale``: sends the global model plus ``--factor`` times its update;
- ``flip``: sends the global model minus ``--factor`` times its update (a sign flip);
- ``nan``: one weight is NaN;
- ``diff``: sends its update as a DIFF where the server expects FULL weights;
- ``metrics``: honest weights, but an accuracy of 1e9 and a metric name with terminal escapes;
- ``steps``: honest weights, but claims 10**9 local steps (the aggregation weight).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from engine import client as flare
from engine.examples import train
from engine.model import FLModel, ParamsType

ATTACKS = ("none", "scale", "flip", "nan", "diff", "metrics", "steps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attack", choices=ATTACKS, default="none")
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--num-shards", type=int, default=0, help="shards of the data; 0: one a site of the job")
    args, rest = parser.parse_known_args()
    if args.num_shards > 0:
        flare.get_num_sites = lambda: args.num_shards
    received: dict[str, torch.Tensor] = {}
    honest_receive, honest_send = flare.receive, flare.send

    def receive(*a: Any, **k: Any) -> FLModel | None:
        model = honest_receive(*a, **k)
        received.clear()
        if model is not None and model.params:
            received.update({name: t.detach().clone() for name, t in model.params.items()})
        return model

    def send(model: FLModel, *a: Any, **k: Any) -> None:
        if model.params and received and model.meta.get("NUM_STEPS_CURRENT_ROUND") is not None:
            model = lie(args.attack, args.factor, received, model)
        honest_send(model, *a, **k)

    flare.receive, flare.send = receive, send  # the script looks them up on the module at each call
    train.main(rest)


def lie(attack: str, factor: float, base: dict[str, torch.Tensor], model: FLModel) -> FLModel:
    """What the liar sends instead of ``model`` (the weights it really trained from ``base``)."""
    trained = model.params or {}
    floats = {name for name, tensor in trained.items() if tensor.is_floating_point()}
    params, params_type = dict(trained), ParamsType.FULL
    if attack in ("scale", "flip"):
        sign = 1.0 if attack == "scale" else -1.0
        params = {n: base[n] + sign * factor * (t - base[n]) if n in floats else t for n, t in trained.items()}
    elif attack == "nan":
        first = sorted(floats)[0]
        params[first] = params[first].clone()
        params[first].view(-1)[0] = float("nan")
    elif attack == "diff":
        params, params_type = {n: t - base[n] for n, t in trained.items() if n in floats}, ParamsType.DIFF
    metrics, meta = model.metrics, dict(model.meta)
    if attack == "metrics":
        metrics = {"global_accuracy": 1e9, "local_accuracy": float("nan"), "\x1b[2Jowned": 1.0}
    if attack == "steps":
        meta["NUM_STEPS_CURRENT_ROUND"] = 10**9
    return FLModel(params=params, params_type=params_type, metrics=metrics, meta=meta)


if __name__ == "__main__":
    main()
