"""BenchNet (../shared/BENCHMARK.md) as an nn.Module, small enough for tests: ``BenchNet(layers, width)``."""

from __future__ import annotations

import torch
from torch import nn


class BenchNet(nn.Module):
    """A stack of ``nn.Linear(width, width)``; layer i drawn from U(-0.05, 0.05), seed ``seed * 100003 + i``."""

    def __init__(self, layers: int = 2, width: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        with torch.no_grad():
            for index, linear in enumerate(self.layers):
                generator = torch.Generator().manual_seed(seed * 100003 + index)
                linear.weight.uniform_(-0.05, 0.05, generator=generator)
                linear.bias.uniform_(-0.05, 0.05, generator=generator)
