"""Exact percentiles of the absolute values of many tensors, without joining them into one.

`abs_percentile` gives what ``numpy.percentile(numpy.abs(all_values), q)`` gives (linear
interpolation between the two order statistics around ``(n - 1) * q / 100``) for the values of
several tensors taken together, with memory for one block of one tensor at a time.

How: the absolute value of a float has a bit pattern that, read as a signed integer, orders like
the value. A radix select finds the k-th smallest pattern 16 bits at a time: one pass over all
blocks counts the top 16 bits of every value into a 65,536-bin histogram, which names the
bucket holding rank k and the rank within it; the next pass counts the next 16 bits of the
values in that bucket only; and so on. float32 values (and float16 / bfloat16, widened exactly)
take 2 passes, float64 values 4. The two order statistics the interpolation needs are found in
the same passes. They are exact; the interpolation between them is done in float64 (numpy does
it in the input's dtype: the two differ by at most one unit in the last place of that dtype).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from engine.filters.updates import blocks

_DIGIT_BITS = 16
_BINS = 1 << _DIGIT_BITS


def abs_percentile(tensors: Mapping[str, torch.Tensor], percentile: float) -> float:
    """The ``percentile`` (0..100) of the absolute values of all elements of ``tensors``, as numpy's.

    Args:
        tensors: Name -> floating-point tensor; none is changed.
        percentile: In ``[0, 100]``.

    Raises:
        ValueError: No values at all, a NaN or infinite value (its tensor named),
            or ``percentile`` outside ``[0, 100]``.
    """
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile: expected a number in [0, 100], got {percentile!r}")
    n = sum(t.numel() for t in tensors.values())
    if n == 0:
        raise ValueError("no values to take a percentile of")
    index = (n - 1) * (percentile / 100)
    lower = min(math.floor(index), n - 1)
    upper = min(lower + 1, n - 1)
    wide = any(t.dtype == torch.float64 for t in tensors.values())
    low_value, high_value = _select(tensors, [lower, upper], torch.float64 if wide else torch.float32)
    gamma = index - lower
    difference = high_value - low_value
    if gamma >= 0.5:  # numpy's lerp: from the nearer end, so that gamma == 1 gives high_value exactly
        return high_value - difference * (1 - gamma)
    return low_value + difference * gamma


def _select(tensors: Mapping[str, torch.Tensor], ranks: list[int], work: torch.dtype) -> list[float]:
    """The values of the given 0-based ranks among the absolute values of ``tensors`` (radix select)."""
    as_int = torch.int64 if work == torch.float64 else torch.int32
    total_bits = 64 if work == torch.float64 else 32
    magnitude = (1 << (total_bits - 1)) - 1  # every bit but the sign: the key of |x|
    infinity_digit = int(torch.tensor(math.inf, dtype=work).view(as_int)) >> (total_bits - _DIGIT_BITS)
    # Per rank: the key bits found so far (the prefix) and the rank left within that prefix.
    targets = [[0, rank] for rank in ranks]
    for level, shift in enumerate(range(total_bits - _DIGIT_BITS, -1, -_DIGIT_BITS)):
        prefixes = sorted({prefix for prefix, _ in targets})
        histograms = {prefix: np.zeros(_BINS, dtype=np.int64) for prefix in prefixes}
        for name, tensor in tensors.items():
            for block in blocks(tensor):
                values = block.detach().reshape(-1)
                values = values if values.dtype == work else values.to(work)  # float16/bfloat16: exact
                if level == 0:
                    keys = values.view(as_int) & magnitude
                    counts = _count(keys.bitwise_right_shift_(shift))
                    if counts[infinity_digit:].any():  # an exponent of all ones: NaN or infinity
                        raise ValueError(f"{name!r} holds NaN or infinite values")
                    histograms[0] += counts
                    continue
                for prefix in prefixes:
                    histograms[prefix] += _count_in_bucket(values.view(as_int) & magnitude, prefix, shift)
        for target in targets:
            counts = np.cumsum(histograms[target[0]])
            digit = int(np.searchsorted(counts, target[1], side="right"))
            below = int(counts[digit - 1]) if digit > 0 else 0
            target[0] = (target[0] << _DIGIT_BITS) | digit
            target[1] -= below
    return [float(torch.tensor([prefix], dtype=as_int).view(work)[0]) for prefix, _ in targets]


def _count_in_bucket(keys: torch.Tensor, prefix: int, shift: int) -> np.ndarray:
    """How often each digit ``(key >> shift) & 0xFFFF`` occurs among the keys whose higher bits are ``prefix``.

    Arithmetic in place instead of a mask and a gather: keys below the bucket become -1 and keys
    above it 65,536, so after ``+ 1`` the bucket's digits are bins 1 .. 65,536 of one bincount.
    """
    span = 1 << (shift + _DIGIT_BITS)
    keys.sub_(prefix * span).clamp_(-1, span).bitwise_right_shift_(shift).add_(1)
    return _count(keys, _BINS + 2)[1 : _BINS + 1]


def _count(digits: torch.Tensor, bins: int = _BINS) -> np.ndarray:
    """How often each value 0 .. bins - 1 occurs in ``digits``."""
    if digits.numel() < _BINS:
        # numpy's: torch's bincount opens a parallel region per call, slow for small blocks on busy cores
        return np.bincount(digits.cpu().numpy(), minlength=bins)
    return torch.bincount(digits, minlength=bins).cpu().numpy()
