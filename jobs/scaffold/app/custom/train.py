"""SCAFFOLD's side of a site (Karimireddy et al., 2020): the digits example's training, with corrected steps.

``flare.ScaffoldClient`` keeps this site's control variate: ``begin_round`` takes the server's
from the task, ``correct`` moves the weights after every optimizer step by ``-lr * (c - c_i)``,
and ``end_round`` gives the change of ``c_i`` to send with the result (the server runs
``engine.workflows.Scaffold``). Otherwise the plain example (``engine/examples/train.py``); the
shard is this site's place among the job's sites, so the script runs at any site name.
"""

from __future__ import annotations

import argparse

import torch

from engine import client as flare
from engine.examples.digits import Net, accuracy, batch_order, load_split, train_locally
from engine.model import FLModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)  # a small model; a simulated job's clients share the cores
    flare.init()
    shard, num_shards = flare.get_site_index(), flare.get_num_sites()
    (train_x, train_y), (val_x, val_y) = load_split(shard, num_shards)
    net = Net(hidden=64)
    scaffold = flare.ScaffoldClient(net)  # this site's c_i, kept in its saved state across rounds

    while flare.is_running():
        received = flare.receive(into=net)  # every task is a training task under Scaffold
        if received is None:
            break
        scaffold.begin_round(received)  # the server's control variate and the weights received
        global_accuracy = accuracy(net, val_x, val_y)
        steps = train_locally(
            net, (train_x, train_y), epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
            order=batch_order(shard, received.current_round),
            after_step=lambda: scaffold.correct(args.lr),  # each step corrected by -lr * (c - c_i)
        )  # fmt: skip
        local_accuracy = accuracy(net, val_x, val_y)
        flare.log("local_accuracy", local_accuracy)
        flare.send(
            FLModel(
                params=net.state_dict(),
                metrics={"global_accuracy": global_accuracy, "local_accuracy": local_accuracy},
                meta={"NUM_STEPS_CURRENT_ROUND": steps, **scaffold.end_round()},
            )
        )


if __name__ == "__main__":
    main()
