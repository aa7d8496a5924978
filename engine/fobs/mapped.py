"""Tensors in mappings of their own, outside glibc's heaps.

A buffer of a few MiB that a thread allocates and frees again and again (a chunk's scratch
space, a block-sized temporary) comes from that thread's malloc arena, below the mmap
threshold that keeps received chunks off fresh mappings (`engine.runtime.process`). Interleaved
with the small allocations of the same thread, such buffers leave arenas that glibc cannot trim:
a server that folds results grew by 5-10 MiB a round that way. A private anonymous mapping is
given back to the system when its last tensor goes, and a mapping that is only ever read costs
no memory at all (every page is the kernel's shared zero page).
"""

from __future__ import annotations

import mmap
import threading
import warnings

import numpy as np
import torch

_zeros_lock = threading.Lock()
_zeros: torch.Tensor = torch.empty(0, dtype=torch.uint8)
#: Views already made, by (numel, dtype); a few sizes are asked for again and again.
_zeros_made: dict[tuple[int, torch.dtype], torch.Tensor] = {}
_ZEROS_KEPT = 64


def mapped_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` in a mapping of its own, unmapped once nothing holds the tensor."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))


def read_only_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` zeros of ``dtype`` that cost no memory, shared by every caller.

    The mapping is read-only: a write to them is a crash, never zeros that silently are not.
    """
    made = _zeros_made.get((numel, dtype))
    if made is not None:  # the server's fold asks for the same block size thousands of times a round
        return made
    nbytes = numel * dtype.itemsize
    global _zeros
    with _zeros_lock:
        if _zeros.numel() < nbytes:
            _zeros = _read_only_mapping(max(nbytes, 2 * _zeros.numel()))
            _zeros_made.clear()  # the views of the smaller mapping would keep it mapped
        made = _zeros[:nbytes].view(dtype)
        if len(_zeros_made) < _ZEROS_KEPT:
            _zeros_made[(numel, dtype)] = made
    return made


def _read_only_mapping(nbytes: int) -> torch.Tensor:
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # torch warns that it cannot make the tensor read-only itself
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
