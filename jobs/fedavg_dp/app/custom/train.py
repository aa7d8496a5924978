"""A site that sends its update, not its weights: the digits example's training, for the privacy filters.

The result is ``trained - received`` with ``params_type = DIFF``: what the client's result filter
(``engine.filters.GaussianPrivacy`` here) clips and adds noise to before anything leaves the site,
and what FedAvg adds to the global model (``expected_params_type = DIFF``). Otherwise the plain
example (``engine/examples/train.py``); the shard is this site's place among the job's sites, so
the script runs at any site name.
"""

from __future__ import annotations

import argparse

import torch

from engine import client as flare
from engine.examples.digits import Net, accuracy, batch_order, load_split, train_locally
from engine.model import FLModel, ParamsType


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

    while flare.is_running():
        model = flare.receive(into=net)  # every task is a training task under FedAvg
        if model is None:
            break
        received = {name: t.detach().clone() for name, t in net.state_dict().items()}
        global_accuracy = accuracy(net, val_x, val_y)
        steps = train_locally(
            net, (train_x, train_y), epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
            order=batch_order(shard, model.current_round),
        )  # fmt: skip
        local_accuracy = accuracy(net, val_x, val_y)
        flare.log("local_accuracy", local_accuracy)
        # trained - received, in the copy's memory: no third model
        update = {name: received[name].sub_(t).neg_() for name, t in net.state_dict().items()}
        flare.send(
            FLModel(
                params=update,
                params_type=ParamsType.DIFF,
                metrics={"global_accuracy": global_accuracy, "local_accuracy": local_accuracy},
                meta={"NUM_STEPS_CURRENT_ROUND": steps},
            )
        )


if __name__ == "__main__":
    main()
