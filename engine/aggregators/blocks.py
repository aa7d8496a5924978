"""Reading a result's value one block of elements at a time, whatever holds it.

A value of a result is a torch tensor, a numpy array, or a lazy reference to a tensor in a
downloaded file (it has ``read_elements``, see `engine.streaming.lazy.LazyRef`). The checks and
the robust aggregators go over values block by block, so that neither a whole lazy tensor nor
the same tensor of every client has to be in memory at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

#: Bytes of one block read from a value (a few MiB: large enough to run at memory speed, small
#: enough that one block of each of many clients fits in memory beside the running sums).
BLOCK_BYTES = 8 * 2**20


def is_lazy(value: Any) -> bool:
    """Whether ``value`` is a lazy reference that can be read a block at a time."""
    return callable(getattr(value, "read_elements", None))


def numel_of(value: Any) -> int:
    """How many elements ``value`` holds (from its shape; a lazy value is not read)."""
    count = 1
    for size in value.shape:
        count *= int(size)
    return count


def torch_dtype_of(value: Any) -> torch.dtype:
    """The value's dtype as a torch dtype (numpy arrays and lazy references alike)."""
    dtype = value.dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def block_elements(dtype: torch.dtype, block_bytes: int = BLOCK_BYTES) -> int:
    """How many elements of ``dtype`` one block holds (at least one)."""
    return max(1, block_bytes // dtype.itemsize)


def read_block(value: Any, start: int, count: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """Elements ``start .. start + count`` of ``value`` flattened, as a 1-D CPU torch tensor.

    For a tensor or array that is a view (no copy, where it is contiguous); a lazy value is read
    from its file into ``buffer`` (which must hold at least ``count`` elements of its dtype) or
    into new memory. The block is valid until ``buffer`` is reused.

    Raises:
        TypeError: ``value`` is neither a tensor, an array nor a lazy reference.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)[start : start + count]
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).reshape(-1)[start : start + count])
    if is_lazy(value):
        dtype = torch_dtype_of(value)
        out = buffer[:count] if buffer is not None else torch.empty(count, dtype=dtype)
        return value.read_elements(start, out)
    raise TypeError(f"cannot read blocks of a value of type {type(value).__name__}")


def iter_blocks(value: Any, block_bytes: int = BLOCK_BYTES) -> Iterator[torch.Tensor]:
    """The value's elements as consecutive 1-D blocks of at most ``block_bytes`` each.

    A lazy value is read into one buffer that every block reuses: use each block before asking
    for the next.
    """
    total = numel_of(value)
    step = block_elements(torch_dtype_of(value), block_bytes)
    buffer = torch.empty(min(step, total), dtype=torch_dtype_of(value)) if is_lazy(value) else None
    for start in range(0, total, step):
        yield read_block(value, start, min(step, total - start), buffer)
