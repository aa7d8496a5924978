"""A stand-in for the lazy tensor references of the disk download feature (duck-typed)."""

from __future__ import annotations

import weakref

import torch


class LazyTensor:
    """Resolves to a fresh copy of ``source`` on each call; counts resolves and releases.

    Attributes:
        resolved: A weakref to each tensor ``resolve()`` returned, to check none is held.
    """

    def __init__(self, source: torch.Tensor, expose_layout: bool = False, fail: bool = False) -> None:
        self._source = source
        self._fail = fail
        self.resolve_calls = 0
        self.release_calls = 0
        self.resolved: list[weakref.ref[torch.Tensor]] = []
        if expose_layout:
            self.shape = source.shape
            self.dtype = source.dtype

    def resolve(self) -> torch.Tensor:
        self.resolve_calls += 1
        if self._fail:
            raise OSError("temp file vanished")
        tensor = self._source.clone()
        self.resolved.append(weakref.ref(tensor))
        return tensor

    def release(self) -> None:
        self.release_calls += 1

    def alive(self) -> int:
        """How many tensors this reference resolved to are still in memory."""
        return sum(ref() is not None for ref in self.resolved)
