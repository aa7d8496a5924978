"""BenchNet, the benchmark model of BENCHMARK.md, built straight as a state dict.

``BenchNet(size_mb, width=2048, seed=0)`` is a stack of ``nn.Linear(width, width)`` layers in
float32; layer i fills its weight, then its bias, from U(-0.05, 0.05) with a generator seeded
``seed * 100003 + i``. Keys are ``layers.{i}.weight`` and ``layers.{i}.bias``.
"""

from __future__ import annotations

import torch

WIDTH = 2048


def layer_count(size_mb: float, width: int = WIDTH) -> int:
    """Layers of a BenchNet of about ``size_mb`` MiB (at least one)."""
    return max(1, round(size_mb * 2**20 / ((width * width + width) * 4)))


def layer(index: int, width: int = WIDTH, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of layer ``index``, exactly as BENCHMARK.md defines them."""
    generator = torch.Generator().manual_seed(seed * 100003 + index)
    weight = torch.empty(width, width).uniform_(-0.05, 0.05, generator=generator)
    bias = torch.empty(width).uniform_(-0.05, 0.05, generator=generator)
    return weight, bias


def state_dict(size_mb: float, width: int = WIDTH, seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole BenchNet state dict."""
    tensors = {}
    for index in range(layer_count(size_mb, width)):
        tensors[f"layers.{index}.weight"], tensors[f"layers.{index}.bias"] = layer(index, width, seed)
    return tensors


def mismatches(tensors: dict[str, torch.Tensor], size_mb: float, width: int = WIDTH, seed: int = 0) -> list[str]:
    """Names of the tensors that differ from BenchNet, checked one layer at a time (little memory)."""
    wrong = []
    for index in range(layer_count(size_mb, width)):
        for name, expected in zip(("weight", "bias"), layer(index, width, seed), strict=True):
            key = f"layers.{index}.{name}"
            if key not in tensors or not torch.equal(tensors[key], expected):
                wrong.append(key)
    return wrong
