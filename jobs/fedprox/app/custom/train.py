"""FedProx's side of a site (Li et al., 2020): the digits example's training, with a proximal term.

The loss of every step gets ``mu / 2 * ||w - w_global||^2`` (``flare.fedprox_loss``), which keeps
the local model near the global one it received: sites with very different data drift less. The
server runs plain FedAvg; ``--mu 0`` trains as the plain example does (``engine/examples/train.py``,
which also answers cross-site evaluation's tasks). The shard is this site's place among the job's
sites, so the script runs at any site name.
"""

from __future__ import annotations

import argparse
import functools

import torch

from engine import client as flare
from engine.examples.digits import Net, accuracy, batch_order, load_split, train_locally
from engine.model import FLModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--mu", type=float, default=0.01, help="the proximal weight (>= 0)")
    args = parser.parse_args()
    if args.mu < 0:
        parser.error(f"--mu must be >= 0, got {args.mu}")

    torch.set_num_threads(1)  # a small model; a simulated job's clients share the cores
    flare.init()
    shard, num_shards = flare.get_site_index(), flare.get_num_sites()
    (train_x, train_y), (val_x, val_y) = load_split(shard, num_shards)
    net = Net(hidden=64)

    while flare.is_running():
        received = flare.receive(into=net)  # every task is a training task under FedAvg
        if received is None:
            break
        global_params = {name: t.detach().clone() for name, t in net.state_dict().items()}  # what w stays near
        global_accuracy = accuracy(net, val_x, val_y)
        steps = train_locally(
            net, (train_x, train_y), epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
            order=batch_order(shard, received.current_round),
            extra_loss=functools.partial(flare.fedprox_loss, net, global_params, args.mu),  # the proximal term
        )  # fmt: skip
        local_accuracy = accuracy(net, val_x, val_y)
        flare.log("local_accuracy", local_accuracy)
        flare.send(
            FLModel(
                params=net.state_dict(),
                metrics={"global_accuracy": global_accuracy, "local_accuracy": local_accuracy},
                meta={"NUM_STEPS_CURRENT_ROUND": steps},
            )
        )


if __name__ == "__main__":
    main()
