"""BenchNet (BENCHMARK.md) as an ``nn.Module`` for the benchmark jobs: ``BenchNet(size_mb)``."""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 2048


class BenchNet(nn.Module):
    """A stack of ``nn.Linear(2048, 2048)`` of about ``size_mb`` MiB, filled as BENCHMARK.md says."""

    def __init__(self, size_mb: float = 256, seed: int = 0) -> None:
        super().__init__()
        count = max(1, round(size_mb * 2**20 / ((WIDTH * WIDTH + WIDTH) * 4)))
        with torch.device("meta"):  # no throw-away default init of a multi-GiB model
            layers = [nn.Linear(WIDTH, WIDTH) for _ in range(count)]
        self.layers = nn.Sequential(*layers).to_empty(device="cpu")
        with torch.no_grad():
            for index, linear in enumerate(self.layers):
                generator = torch.Generator().manual_seed(seed * 100003 + index)
                linear.weight.uniform_(-0.05, 0.05, generator=generator)
                linear.bias.uniform_(-0.05, 0.05, generator=generator)
