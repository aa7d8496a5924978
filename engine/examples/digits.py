"""The handwritten digits example: the data, split into a shared validation set and client shards, and the MLP.

``data/digits.csv.gz`` is the UCI "Optical Recognition of Handwritten Digits" test set (1797
8x8 images, pixel values 0..16, label last; E. Alpaydin and C. Kaynak, 1998, CC BY 4.0), as
bundled with scikit-learn. Every client validates on the same 20% hold-out, so accuracies are
comparable; the other 80% is dealt out to the shards, one a site (the Client API's
``get_site_index`` of ``get_num_sites``). With more sites than the data has room for
(``MIN_SHARD_SAMPLES`` each), as in a simulation of thousands of clients, each site draws
``DRAWN_SHARD_SAMPLES`` samples at random with its shard as the seed instead: shards overlap.
The jobs under ``jobs/`` and the job folders of ``flengine new`` train `Net` on it (their
training scripts import this module, their persistor names ``engine.examples.digits.Net``).
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

DATA_FILE = Path(__file__).parent / "data" / "digits.csv.gz"
VALIDATION_FRACTION = 0.2
SEED = 0
#: Shards are dealt out apart while each gets at least this many training samples...
MIN_SHARD_SAMPLES = 32
#: ...beyond (more sites than that allows), each site draws this many samples of its own, shards overlapping.
DRAWN_SHARD_SAMPLES = 512


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All images (N x 64, scaled to 0..1) and labels (N)."""
    with gzip.open(DATA_FILE, "rt") as rows:
        table = np.loadtxt(rows, delimiter=",", dtype=np.float32)
    return torch.from_numpy(table[:, :-1] / 16.0), torch.from_numpy(table[:, -1].astype(np.int64))


Split = tuple[torch.Tensor, torch.Tensor]


def load_split(shard: int, num_shards: int) -> tuple[Split, Split]:
    """``((train_x, train_y), (val_x, val_y))`` of one shard (0-based) of ``num_shards``."""
    images, labels = load_digits()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SEED))
    n_val = int(len(labels) * VALIDATION_FRACTION)
    val, train = order[:n_val], order[n_val:]
    if len(train) // num_shards >= MIN_SHARD_SAMPLES:
        mine = train[shard % num_shards :: num_shards]
    else:  # a sample of its own, drawn with the shard's seed
        draw = torch.Generator().manual_seed(SEED + 1 + shard % num_shards)
        mine = train[torch.randperm(len(train), generator=draw)[:DRAWN_SHARD_SAMPLES]]
    return (images[mine], labels[mine]), (images[val], labels[val])


class Net(nn.Module):
    """Two-layer perceptron: 64 -> hidden -> 10.

    Args:
        hidden: Width of the hidden layer. Default 64.
    """

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits for a batch of flattened 8x8 images."""
        return self.layers(x)


def batch_order(shard: int, current_round: int | None) -> torch.Generator:
    """The generator that shuffles a site's batches in a round, seeded by the site's shard and the round.

    The same batches whether the training loop runs once for the whole job (a client process) or
    once per task (a virtual client of ``flengine run -t``): both give the same model.
    """
    return torch.Generator().manual_seed(shard * 1_000_003 + (current_round or 0))


def train_locally(
    net: nn.Module,
    data: Split,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    order: torch.Generator,
    extra_loss: Callable[[], torch.Tensor] | None = None,
    after_step: Callable[[], None] | None = None,
) -> int:
    """Train ``net`` on ``data`` with SGD (momentum 0.9) and cross-entropy; return the number of steps.

    The algorithm examples' loop: ``extra_loss()`` is added to each batch's loss (FedProx's
    proximal term), ``after_step()`` runs after each optimizer step (SCAFFOLD's correction).
    """
    images, labels = data
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    steps = 0
    for _ in range(epochs):
        for batch in torch.randperm(len(labels), generator=order).split(batch_size):
            optimizer.zero_grad()
            loss = loss_fn(net(images[batch]), labels[batch])
            if extra_loss is not None:
                loss = loss + extra_loss()
            loss.backward()
            optimizer.step()
            if after_step is not None:
                after_step()
            steps += 1
    return steps


def accuracy(net: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of ``images`` (0..1) that ``net`` labels right; ``net`` is left in eval mode."""
    net.eval()
    with torch.no_grad():
        return (net(images).argmax(dim=1) == labels).float().mean().item()
