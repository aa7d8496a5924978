"""The benchmark client as a script that trains a network: BenchNet receives each round into itself.

``flare.receive(into=net)`` writes the global model into ``net``'s own parameters (the chunks land
there as they arrive), so the process holds this one network and no second model. A training
step per layer (autograd, one layer's gradient alive at a time) moves every parameter by
``k * 0.001``, as BENCHMARK.md's client k does, and the script sends ``net.state_dict()`` with
``NUM_STEPS_CURRENT_ROUND = k * 100``; the final model is checked like the plain loop's.

    task_script_args = "--size-mb 1024"     # the server's BenchNet size
"""

from __future__ import annotations

import argparse

import torch
from benchnet_module import BenchNet

from engine import client as flare
from engine.model import FLModel


def train_step(net: BenchNet, step: float) -> None:
    """One SGD step (lr 1) on ``-step * sum(params)``, layer by layer: every parameter gains ``step``."""
    for layer in net.layers:
        loss = -step * (layer.weight.sum() + layer.bias.sum())
        loss.backward()
        with torch.no_grad():
            for parameter in (layer.weight, layer.bias):
                parameter.sub_(parameter.grad)
                parameter.grad = None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=float, required=True, help="the server's BenchNet size in MiB")
    args = parser.parse_args()
    flare.init()
    k = int(flare.get_site_name().rsplit("-", 1)[-1])
    net = BenchNet(args.size_mb, seed=1)  # its own weights until the first receive overwrites them
    while flare.is_running():
        model = flare.receive(into=net)
        if model is None:
            break
        train_step(net, k * 0.001)
        flare.send(FLModel(params=net.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": k * 100}))


if __name__ == "__main__":
    main()
