"""A model class in a job's own code (custom/net.py), for the recipe tests: the digits MLP, 64 -> hidden -> 10."""

from __future__ import annotations

import torch
from torch import nn


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
