"""The digits example's training script: a site's side of FedAvg, Swarm and cross-site evaluation.

Each site trains the digits MLP on its own shard of the data. The shard is the site's place among
the job's sites (``flare.get_site_index()`` of ``flare.get_num_sites()``), so the script runs at
any site name, in the simulator as in production. What each task does:

- ``train``: train the received model ``--epochs`` epochs and send it back, with the number of
  steps (FedAvg's weight) and the validation accuracy before (global) and after (local);
- ``validate``: send the received model's accuracy on this site's part of the validation set;
- ``submit_model``: send this site's own model as last trained (cross-site evaluation).

``flengine new`` writes this file into a new job as ``app/custom/train.py``, to edit; the jobs of
the flengine repository run it as ``engine.examples.train``. FedProx, SCAFFOLD and sending weight
differences each have their own script: ``jobs/fedprox``, ``jobs/scaffold``, ``jobs/fedavg_dp``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch import nn

from engine import client as flare
from engine.examples.digits import Net, accuracy, batch_order, load_split
from engine.model import FLModel


def main(argv: Sequence[str] | None = None) -> None:
    """Answer the job's tasks until it ends; ``argv`` is the script's arguments (default: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64, help="width of the MLP; the server's model must match")
    args = parser.parse_args(argv)

    # A small model gains nothing from threads, and a simulated job's clients share the cores.
    torch.set_num_threads(1)
    flare.init()
    shard, num_shards = flare.get_site_index(), flare.get_num_sites()
    (train_x, train_y), (val_x, val_y) = load_split(shard, num_shards)
    torch.manual_seed(shard)
    net = Net(hidden=args.hidden)
    loss_fn = nn.CrossEntropyLoss()

    while flare.is_running():
        received = flare.receive(into=net)  # the task's weights land in net's own tensors
        if received is None:
            break
        if flare.get_task_name() == "submit_model":  # kept while net trains on: a copy
            flare.send(FLModel(params={name: t.detach().clone() for name, t in net.state_dict().items()}))
            continue
        if flare.is_evaluate():
            mine = slice(shard, None, num_shards)
            flare.send(FLModel(metrics={"accuracy": accuracy(net, val_x[mine], val_y[mine])}))
            continue

        global_accuracy = accuracy(net, val_x, val_y)
        optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
        net.train()
        steps = 0
        order = batch_order(shard, received.current_round)  # the same batches however the loop is run
        for _ in range(args.epochs):
            for batch in torch.randperm(len(train_y), generator=order).split(args.batch_size):
                optimizer.zero_grad()
                loss_fn(net(train_x[batch]), train_y[batch]).backward()
                optimizer.step()
                steps += 1
        local_accuracy = accuracy(net, val_x, val_y)
        flare.log("local_accuracy", local_accuracy)
        flare.send(
            FLModel(
                params=net.state_dict(),  # net's own tensors: served to the server before the next task
                metrics={"global_accuracy": global_accuracy, "local_accuracy": local_accuracy},
                meta={"NUM_STEPS_CURRENT_ROUND": steps},
            )
        )


if __name__ == "__main__":
    main()
