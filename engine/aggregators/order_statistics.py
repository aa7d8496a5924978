"""Coordinate-wise order statistics of a stack of rows: the k-th smallest value of each column.

The robust aggregators stack the same block of every client's tensor into an ``(n, c)`` tensor
and need, per column, the middle value (median) or the middle values (trimmed mean). For the
few dozen clients of a federation a sorting network is far faster than ``torch.sort(dim=0)``:
each of its comparators is one ``torch.minimum`` and one ``torch.maximum`` over whole rows
(vectorised, at memory speed), where ``torch.sort`` sorts each of the ``c`` short columns on its
own. Comparators that cannot change the wanted positions are left out.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch

#: Up to this many rows the order statistics come from a sorting network (Batcher's odd-even
#: merge sort, about n log^2 n / 4 comparators); above it from ``torch.sort``.
NETWORK_MAX_ROWS = 128


def _merge(lo: int, hi: int, r: int) -> Iterator[tuple[int, int]]:
    step = r * 2
    if step < hi - lo:
        yield from _merge(lo, hi, step)
        yield from _merge(lo + r, hi, step)
        yield from ((i, i + r) for i in range(lo + r, hi - r, step))
    else:
        yield (lo, lo + r)


def _merge_sort(lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """Batcher's odd-even merge sort of positions ``lo..hi`` (both included, a power of 2 long)."""
    if hi - lo >= 1:
        mid = lo + (hi - lo) // 2
        yield from _merge_sort(lo, mid)
        yield from _merge_sort(mid + 1, hi)
        yield from _merge(lo, hi, 1)


@functools.lru_cache(maxsize=256)
def sorting_comparators(n: int, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """The comparators ``(i, j)``, ``i < j``, that put the values of sorted positions ``lo..hi-1`` in place.

    Applying them in order (position ``i`` gets the smaller value, ``j`` the larger) leaves at
    each position in ``lo..hi-1`` the value a full sort would put there. The network is
    Batcher's for the next power of two; comparators past ``n`` are dropped (as if the missing
    rows held +inf, which never moves), and so are those no wanted position depends on.

    Raises:
        ValueError: ``0 <= lo < hi <= n`` does not hold.
    """
    if not 0 <= lo < hi <= n:
        raise ValueError(f"positions {lo}..{hi - 1} are not positions of {n} rows")
    size = 1
    while size < n:
        size *= 2
    comparators = [(i, j) for i, j in _merge_sort(0, size - 1) if j < n]
    needed = set(range(lo, hi))
    kept = []
    for i, j in reversed(comparators):
        if i in needed or j in needed:
            kept.append((i, j))
            needed.update((i, j))
    return tuple(reversed(kept))


def order_statistics(
    rows: torch.Tensor, lo: int, hi: int, spare: torch.Tensor, max_network_rows: int = NETWORK_MAX_ROWS
) -> list[torch.Tensor]:
    """The ``lo``-th .. ``(hi-1)``-th smallest value of each column of ``rows``, one 1-D tensor each.

    ``rows`` (``(n, c)``) and ``spare`` (``(c,)``, same dtype) are scratch: their contents are
    overwritten and the returned tensors may be views of either. NaN compares as neither smaller
    nor larger in a network; callers that may see NaN replace it first (see `nan_as_largest`).

    Args:
        rows: One row per client, one column per coordinate.
        lo: The first wanted sorted position (0 = the smallest value).
        hi: One past the last wanted sorted position.
        spare: A scratch row.
        max_network_rows: Up to this many rows use the sorting network, above it ``torch.sort``.

    Example:
        >>> rows = torch.tensor([[3.0, 0.0], [1.0, 5.0], [2.0, 4.0]])
        >>> order_statistics(rows, 1, 2, torch.empty(2))  # the medians
        [tensor([2., 4.])]
    """
    count = rows.shape[0]
    if count > max_network_rows:
        return list(torch.sort(rows, dim=0).values[lo:hi].unbind(0))
    current = list(rows.unbind(0))
    for i, j in sorting_comparators(count, lo, hi):
        small, large = current[i], current[j]
        torch.minimum(small, large, out=spare)
        torch.maximum(small, large, out=large)
        current[i], spare = spare, small  # the old row of position i is the next scratch row
    return current[lo:hi]


def nan_as_largest(rows: torch.Tensor) -> torch.Tensor:
    """Replace NaN by +inf in place (as ``torch.sort`` orders it), so one NaN does not spread."""
    if math.isnan(float(rows.sum())):  # a sum reads faster than a replacement writes; NaN is rare
        rows.nan_to_num_(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    return rows
