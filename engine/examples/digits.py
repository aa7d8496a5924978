"""The handwritten digits example: the data, split into a shared validation set and client shards, and the MLP.

``data/digits.csv.gz`` is the UCI "Optical Recognition of Handwritten Digits" test set (1797
8x8 images, pixel values 0..16, label last; E. Alpaydin and C. Kaynak, 1998, CC BY 4.0), as
bundled with scikit-learn. Every client validates on the same 20% hold-out, so accuracies are
comparable; the other 80% is dealt out to the shards, one a site (the Client API's
``get_site_index`` of ``get_num_sites``). The jobs under ``jobs/`` and the job folders of
``flengine new`` train `Net` on it (their training scripts import this module, their persistor
names ``engine.examples.digits.Net``).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
from torch import nn

DATA_FILE = Path(__file__).parent / "data" / "digits.csv.gz"
VALIDATION_FRACTION = 0.2
SEED = 0


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
    mine = train[shard % num_shards :: num_shards]
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


def accuracy(net: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of ``images`` (0..1) that ``net`` labels right; ``net`` is left in eval mode."""
    net.eval()
    with torch.no_grad():
        return (net(images).argmax(dim=1) == labels).float().mean().item()
