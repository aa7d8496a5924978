"""Training script of the digits jobs: trains the received model on this site's shard with the Client API.

``train`` (any task but the two below): load the received weights, report the received (global)
model's validation accuracy, train ``--epochs`` epochs, and send the weights back with the number
of steps (the FedAvg weight) and the trained model's validation accuracy. ``validate``: send the
received model's accuracy on this site's part of the validation set (cross-site evaluation: each
site judges with data of its own). ``submit_model``: send this site's own model as last trained.
"""

from __future__ import annotations

import argparse

import torch
from digits import load_split
from net import Net
from torch import nn

from engine import client as flare
from engine.model import FLModel


def accuracy(net: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        return (net(images).argmax(dim=1) == labels).float().mean().item()


def train(net: nn.Module, images: torch.Tensor, labels: torch.Tensor, args: argparse.Namespace) -> int:
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(args.seed)
    steps = 0
    net.train()
    for _ in range(args.epochs):
        for batch in torch.randperm(len(labels), generator=generator).split(args.batch_size):
            optimizer.zero_grad()
            loss_fn(net(images[batch]), labels[batch]).backward()
            optimizer.step()
            steps += 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-shards", type=int, default=2, help="how many parts the training data is dealt into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()

    # A small model gains nothing from several threads, and the clients of a simulated job share
    # this machine's cores: more threads than cores make every step wait on the others.
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
        if flare.get_task_name() == "submit_model":
            flare.send(FLModel(params={name: t.detach().clone() for name, t in net.state_dict().items()}))
            continue
        if flare.is_evaluate():
            evaluated = Net(hidden=args.hidden)
            evaluated.load_state_dict(received.params)
            mine = slice(site_index, None, args.num_shards)
            flare.send(FLModel(metrics={"accuracy": accuracy(evaluated, val_x[mine], val_y[mine])}))
            continue
        net.load_state_dict(received.params)
        global_accuracy = accuracy(net, val_x, val_y)
        steps = train(net, train_x, train_y, args)
        local_accuracy = accuracy(net, val_x, val_y)
        flare.log("local_accuracy", local_accuracy)
        flare.send(
            FLModel(
                params={name: tensor.detach().clone() for name, tensor in net.state_dict().items()},
                metrics={"global_accuracy": global_accuracy, "local_accuracy": local_accuracy},
                meta={"NUM_STEPS_CURRENT_ROUND": steps},
            )
        )


if __name__ == "__main__":
    main()
