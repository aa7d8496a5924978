"""A digits training script that lies: it trains as jobs/fedavg's train.py does, then corrupts what it sends.

Only for tests and `tools/bench_robust.py` (a site that holds a valid key and lies); the job
generator in `tools/liars/job.py` deploys it to the lying sites. ``--attack``:

- ``none``: honest (the same as train.py);
- ``scale``: sends the global model plus ``--factor`` times its update;
- ``flip``: sends the global model minus ``--factor`` times its update (a sign flip);
- ``nan``: one weight is NaN;
- ``diff``: sends its update as a DIFF where the server expects FULL weights;
- ``metrics``: honest weights, but an accuracy of 1e9 and a metric name with terminal escapes;
- ``steps``: honest weights, but claims 10**9 local steps (the aggregation weight).
"""

from __future__ import annotations

import argparse

import torch
from digits import load_split
from net import Net
from train import accuracy, train

from engine import client as flare
from engine.model import FLModel, ParamsType

ATTACKS = ("none", "scale", "flip", "nan", "diff", "metrics", "steps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attack", choices=ATTACKS, default="none")
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-shards", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()

    torch.set_num_threads(1)
    flare.init()
    site_index = int(flare.get_site_name().rsplit("-", 1)[-1]) - 1
    (train_x, train_y), (val_x, val_y) = load_split(site_index, args.num_shards)
    torch.manual_seed(args.seed + site_index)
    net = Net(hidden=args.hidden)
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        if flare.is_evaluate() or flare.get_task_name() == "submit_model":
            flare.send(FLModel(metrics={"accuracy": 1.0}))
            continue
        net.load_state_dict(received.params)
        base = {name: tensor.detach().clone() for name, tensor in net.state_dict().items()}
        global_accuracy = accuracy(net, val_x, val_y)
        steps = train(net, train_x, train_y, args)
        trained = {name: tensor.detach().clone() for name, tensor in net.state_dict().items()}
        sent, params_type = lie(args.attack, args.factor, base, trained)
        metrics = {"global_accuracy": global_accuracy, "local_accuracy": accuracy(net, val_x, val_y)}
        if args.attack == "metrics":
            metrics = {"global_accuracy": 1e9, "local_accuracy": float("nan"), "\x1b[2Jowned": 1.0}
        flare.send(
            FLModel(
                params=sent,
                params_type=params_type,
                metrics=metrics,
                meta={"NUM_STEPS_CURRENT_ROUND": 10**9 if args.attack == "steps" else steps},
            )
        )


def lie(
    attack: str, factor: float, base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], ParamsType]:
    """What the liar sends instead of ``trained`` (the weights it really trained from ``base``)."""
    floats = {name for name, tensor in trained.items() if tensor.is_floating_point()}
    if attack == "scale":
        return {n: base[n] + factor * (t - base[n]) if n in floats else t for n, t in trained.items()}, ParamsType.FULL
    if attack == "flip":
        return {n: base[n] - factor * (t - base[n]) if n in floats else t for n, t in trained.items()}, ParamsType.FULL
    if attack == "nan":
        first = sorted(floats)[0]
        trained[first].view(-1)[0] = float("nan")
        return trained, ParamsType.FULL
    if attack == "diff":
        return {n: t - base[n] for n, t in trained.items() if n in floats}, ParamsType.DIFF
    return trained, ParamsType.FULL


if __name__ == "__main__":
    main()
