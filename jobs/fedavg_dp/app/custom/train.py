"""Training script of the digits jobs: trains the received model on this site's shard with the Client API.

Every task's weights are received straight into the network (``flare.receive(into=net)``): the
script holds this one network, never a second model beside it. ``train`` (any task but the two
below): report the received (global) model's validation accuracy, train ``--epochs`` epochs, and
send the weights back with the number of steps (the FedAvg weight) and the trained model's
validation accuracy. ``validate``: send the received model's accuracy on this site's part of the
validation set (cross-site evaluation: each site judges with data of its own; it comes after
training and after this site's ``submit_model``, so the network may take the model under test).
``submit_model``: send this site's own model as last trained (the task carries no weights, so
the network is left as it is).

Algorithm options (each keeps a copy of the received weights while it trains, the one extra
model they need): ``--mu M`` adds FedProx's proximal term ``M / 2 * ||w - w_global||^2`` to the
loss; ``--scaffold`` corrects each step with SCAFFOLD's control variates (the server runs
``engine.workflows.Scaffold``); ``--params-type DIFF`` sends the trained weights minus the
received ones (what the privacy filters work on; FedAvg then sets ``expected_params_type = DIFF``).
The data and the model are the example's, imported from ``engine.examples.digits``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from engine import client as flare
from engine.examples.digits import Net, load_split
from engine.model import FLModel, ParamsType


def accuracy(net: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        return (net(images).argmax(dim=1) == labels).float().mean().item()


def train(
    net: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    args: argparse.Namespace,
    global_params: dict[str, torch.Tensor] | None,
    scaffold: flare.ScaffoldClient | None,
) -> int:
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(args.seed)
    steps = 0
    net.train()
    for _ in range(args.epochs):
        for batch in torch.randperm(len(labels), generator=generator).split(args.batch_size):
            optimizer.zero_grad()
            loss = loss_fn(net(images[batch]), labels[batch])
            if args.mu > 0 and global_params is not None:
                loss = loss + flare.fedprox_loss(net, global_params, args.mu)
            loss.backward()
            optimizer.step()
            if scaffold is not None:
                scaffold.correct(args.lr)
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
    parser.add_argument("--mu", type=float, default=0.0, help="FedProx's proximal weight; 0 = plain FedAvg")
    parser.add_argument("--scaffold", action="store_true", help="SCAFFOLD's corrected steps (server: Scaffold)")
    parser.add_argument(
        "--params-type",
        choices=[t.value for t in ParamsType],
        default=ParamsType.FULL.value,
        help="send the trained weights (FULL) or their difference to the received ones (DIFF)",
    )
    args = parser.parse_args()
    if args.mu < 0:
        parser.error(f"--mu must be >= 0, got {args.mu}")

    # A small model gains nothing from several threads, and the clients of a simulated job share
    # this machine's cores: more threads than cores make every step wait on the others.
    torch.set_num_threads(1)
    flare.init()
    site_index = int(flare.get_site_name().rsplit("-", 1)[-1]) - 1
    (train_x, train_y), (val_x, val_y) = load_split(site_index, args.num_shards)
    torch.manual_seed(args.seed + site_index)
    net = Net(hidden=args.hidden)
    scaffold = flare.ScaffoldClient(net) if args.scaffold else None
    keep_received = args.mu > 0 or args.params_type == ParamsType.DIFF.value
    while flare.is_running():
        received = flare.receive(into=net)  # the task's weights land in net's own tensors
        if received is None:
            break
        if flare.get_task_name() == "submit_model":
            # Kept by the engine for cross-site evaluation while net may change: a copy.
            flare.send(FLModel(params={name: t.detach().clone() for name, t in net.state_dict().items()}))
            continue
        if flare.is_evaluate():
            mine = slice(site_index, None, args.num_shards)
            flare.send(FLModel(metrics={"accuracy": accuracy(net, val_x[mine], val_y[mine])}))
            continue
        global_accuracy = accuracy(net, val_x, val_y)
        start = {name: t.detach().clone() for name, t in net.state_dict().items()} if keep_received else None
        if scaffold is not None:
            scaffold.begin_round(received)
        steps = train(net, train_x, train_y, args, start, scaffold)
        local_accuracy = accuracy(net, val_x, val_y)
        flare.log("local_accuracy", local_accuracy)
        meta = {"NUM_STEPS_CURRENT_ROUND": steps, **(scaffold.end_round() if scaffold is not None else {})}
        params = net.state_dict()  # net's own tensors: served to the server before the next task arrives
        if args.params_type == ParamsType.DIFF.value:
            params = {name: start[name].sub_(t).neg_() for name, t in params.items()}  # trained - received
        flare.send(
            FLModel(
                params=params,
                params_type=ParamsType(args.params_type),
                metrics={"global_accuracy": global_accuracy, "local_accuracy": local_accuracy},
                meta=meta,
            )
        )


if __name__ == "__main__":
    main()
