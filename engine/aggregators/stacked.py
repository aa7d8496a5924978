"""Stacking the same block of several clients' values: `BlockStack` and `combine_values`.

A robust rule looks at the same coordinates of every result at once. `BlockStack` reads the
same block of each value (a tensor, a numpy array, or a lazy reference to a tensor in a
downloaded file, see `engine.aggregators.blocks`) into one ``(n, c)`` tensor, with buffers that
every block reuses; `combine_values` turns such blocks into one output value with a rule. Peak
memory is the output plus about one block per client, whatever the size of the values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from engine.aggregators.blocks import block_elements, is_lazy, numel_of, read_block, torch_dtype_of
from engine.errors import ResultRefused
from engine.fobs.tensor_pool import pooled_empty

#: Bytes of one client's block: the robust aggregators hold one such block of every client at
#: once (plus scratch rows of the same size), and a block this small stays in the CPU's cache
#: while a sorting network goes over it.
PER_CLIENT_BLOCK_BYTES = 2**20

#: Combines one block: ``(rows, spare) -> values``, where ``rows`` is ``(n, c)`` (one row per
#: result, in the compute dtype) and ``spare`` a ``(c,)`` scratch row; both may be overwritten,
#: and the ``(c,)`` result may be a view of either.
BlockRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a block of ``dtype`` is combined in: float64 for float64 and integers, else float32."""
    if dtype == torch.float64 or not dtype.is_floating_point:
        return torch.float64
    return torch.float32


def check_block_bytes(value: Any) -> int:
    """Return the ``block_bytes`` arg, checked: an integer >= 1.

    Raises:
        ValueError: It is not an integer >= 1.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"block_bytes: expected an integer >= 1 (bytes per client and block), got {value!r}")
    return value


def compile_exclude_vars(exclude_vars: str | None) -> re.Pattern[str] | None:
    """The ``exclude_vars`` arg compiled; None when it is None or empty.

    Raises:
        ValueError: It is not a valid regular expression.
    """
    try:
        return re.compile(exclude_vars) if exclude_vars else None
    except re.error as e:
        raise ValueError(f"exclude_vars: {exclude_vars!r} is not a valid regular expression: {e}") from e


def settled_params(
    params: Mapping[str, Any], exclude: re.Pattern[str] | None, contributor: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a result's params into the ones to aggregate (checked, contiguous) and the excluded ones.

    A value must be a torch tensor, a numpy array, or a lazy reference (with ``read_elements``,
    ``shape`` and ``dtype``) that is still readable; complex values are refused. A
    non-contiguous tensor or array is made contiguous here, once, so that reading its blocks
    does not copy it each time.

    Raises:
        ResultRefused: A value is of another type, complex, or a lazy one whose file is damaged;
            the message names the contributor and the param.
    """
    kept, excluded = {}, {}
    for name, value in params.items():
        if exclude is not None and exclude.search(name):
            excluded[name] = value
            continue
        where = f"result of {contributor}: param {name!r}"
        if isinstance(value, torch.Tensor):
            value = value.detach().contiguous()
        elif isinstance(value, np.ndarray):
            value = value if value.flags.c_contiguous else value.copy(order="C")  # ascontiguousarray makes 0-d 1-d
        elif is_lazy(value):
            verify = getattr(value, "verify", None)
            if callable(verify):
                try:
                    verify()
                except Exception as e:
                    raise ResultRefused(f"{where}: {e}") from e
        else:
            raise ResultRefused(
                f"{where} is a {type(value).__name__}; robust aggregators take torch tensors, numpy arrays "
                "or lazy references to downloaded tensors"
            )
        if torch_dtype_of(value).is_complex:
            raise ResultRefused(f"{where}: complex tensors cannot be aggregated")
        kept[name] = value
    return kept, excluded


def returns_numpy(value: Any) -> bool:
    """Whether the aggregate of ``value`` goes back as a numpy array (arrays and lazy arrays)."""
    return isinstance(value, np.ndarray) or bool(getattr(value, "as_numpy", False))


#: Bytes between the starts of consecutive rows of a stack beyond the rows' own length, so
#: that rows do not start at the same offset within a page: rows a whole number of pages apart
#: made ``torch.minimum(a, b, out=c)`` some hundred times slower on a 2-thread VM (aliasing).
ROW_STAGGER_BYTES = 320


def staggered_rows(count: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized ``(count, length)`` tensor whose contiguous rows start at staggered offsets."""
    stride = length + -(-ROW_STAGGER_BYTES // torch.empty(0, dtype=dtype).element_size())
    return torch.empty(count * stride, dtype=dtype).as_strided((count, length), (stride, 1))


class BlockStack:
    """The same block of several values, stacked as one ``(n, c)`` tensor per block.

    Iterating yields ``(start, rows)`` for consecutive blocks: ``rows[i]`` holds elements
    ``start .. start + c`` of ``values[i]`` (flattened) in `compute_dtype`. The stack and the read
    buffers of lazy values are allocated once and reused by every block, so ``rows`` is only
    valid until the next block; the caller may overwrite it, and use the ``scratch`` rows.

    Args:
        values: Values of one dtype and shape (tensors, arrays, lazy references).
        block_bytes: Bytes of one value's block, in the values' dtype.
        scratch_rows: How many scratch rows of a block's length (in `compute_dtype`) to add.
    """

    def __init__(self, values: Sequence[Any], block_bytes: int, scratch_rows: int = 0) -> None:
        first = values[0]
        self.values = values
        self.dtype = torch_dtype_of(first)
        self.compute_dtype = compute_dtype(self.dtype)
        self.numel = numel_of(first)
        self.shape = tuple(int(size) for size in first.shape)
        self.step = max(1, min(block_elements(self.dtype, block_bytes), self.numel))
        self._stack = staggered_rows(len(values) + scratch_rows, self.step, self.compute_dtype)
        #: Rows of ``step`` elements for the caller's intermediate results.
        self.scratch = list(self._stack[len(values) :].unbind(0))

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        count = len(self.values)
        stack = self._stack[:count]
        # A lazy value of the compute dtype is read straight into its row; others need a buffer.
        same = self.dtype == self.compute_dtype
        lazy = [is_lazy(value) for value in self.values]
        buffers = staggered_rows(sum(lazy), self.step, self.dtype).unbind(0) if any(lazy) and not same else ()
        reads = iter(buffers)
        targets = [stack[i] if lazy[i] and same else next(reads) if lazy[i] else None for i in range(count)]
        for start in range(0, self.numel, self.step):
            size = min(self.step, self.numel - start)
            for i, value in enumerate(self.values):
                row = stack[i, :size]
                block = read_block(value, start, size, targets[i])
                if block.data_ptr() != row.data_ptr():
                    row.copy_(block)
            yield start, stack[:, :size]


def combine_values(values: Sequence[Any], rule: BlockRule, block_bytes: int) -> torch.Tensor | np.ndarray:
    """Combine same-shaped values coordinate by coordinate with ``rule``, one block at a time.

    The result has the values' shape and dtype (integers rounded), and is a numpy array when
    the first value is one (or a lazy reference that resolves to one).
    """
    blocks = BlockStack(values, block_bytes, scratch_rows=1)
    shaped = pooled_empty(blocks.shape, blocks.dtype)  # the memory of last round's output, where free
    out = shaped.reshape(-1)
    spare = blocks.scratch[0]
    integral = not blocks.dtype.is_floating_point
    for start, rows in blocks:
        count = rows.shape[1]
        combined = rule(rows, spare[:count])
        if integral:
            combined = combined.round_()
        out[start : start + count].copy_(combined)
    return shaped.numpy() if returns_numpy(values[0]) else shaped
