"""Checks of a result before it is aggregated: it matches the model, its values are finite."""

from __future__ import annotations

import cmath
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from engine.aggregators.blocks import BLOCK_BYTES, iter_blocks, torch_dtype_of
from engine.errors import ResultRefused
from engine.fobs.mapped import read_only_zeros

#: How many problems of each sort an error message lists before it says "and N more".
MAX_LISTED = 5


def _dtype_name(dtype: Any) -> str:
    """A dtype's name that torch and numpy share (``float32``), whichever library it comes from."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _layout(value: Any) -> tuple[tuple[int, ...] | None, str | None]:
    """The value's shape and dtype name where it exposes them (never resolving a lazy value)."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    return (
        tuple(shape) if shape is not None else None,
        _dtype_name(dtype) if dtype is not None else None,
    )


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown if len(items) <= MAX_LISTED else f"{shown} and {len(items) - MAX_LISTED} more"


def check_params_match(reference: Mapping[str, Any], params: Mapping[str, Any], contributor: str) -> None:
    """Check that ``params`` holds the same names, shapes and dtypes as ``reference``.

    A value's shape and dtype are read from its ``shape`` and ``dtype`` attributes (tensors,
    arrays, and lazy values that expose them); a value without them is not compared, and a lazy
    value is never resolved to find out.

    Args:
        reference: The model's params, name -> tensor or array.
        params: The contributor's params.
        contributor: Who sent ``params``, e.g. ``"site-1"``; named in the error.

    Raises:
        ResultRefused: Names are missing or unexpected, or shapes or dtypes differ; the message
            names the contributor and the first few of each.

    Example:
        >>> check_params_match({"w": torch.zeros(2)}, {"w": torch.zeros(3)}, "site-1")
        Traceback (most recent call last):
        ...
        engine.errors.ResultRefused: result of site-1 does not match the model: 'w': shape (3,), expected (2,)
    """
    missing = [repr(name) for name in reference if name not in params]
    unexpected = [repr(name) for name in params if name not in reference]
    different = []
    for name, expected in reference.items():
        if name not in params:
            continue
        shape, dtype = _layout(params[name])
        expected_shape, expected_dtype = _layout(expected)
        if shape is not None and expected_shape is not None and shape != expected_shape:
            different.append(f"{name!r}: shape {shape}, expected {expected_shape}")
        if dtype is not None and expected_dtype is not None and dtype != expected_dtype:
            different.append(f"{name!r}: dtype {dtype}, expected {expected_dtype}")
    problems = []
    if missing:
        problems.append(f"missing {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listed(unexpected)}")
    if different:
        problems.append(_listed(different))
    if problems:
        raise ResultRefused(f"result of {contributor} does not match the model: {'; '.join(problems)}")


def non_finite_values(params: Mapping[str, Any]) -> list[str]:
    """Names of the values of ``params`` that hold a NaN or an infinity, in order.

    Tensors and arrays of a floating or complex dtype are scanned a block at a time (a lazy value
    is read from its file block by block, never whole); numbers are checked as they are; integer
    and boolean values cannot be non-finite and are skipped.
    """
    found = []
    for name, value in params.items():
        if type(value) is torch.Tensor and value.is_cpu and value.dim() == 1 and value.numel() <= _ONE_CALL_MAX:
            # A block of a chunk, as the server's fold checks each: one call, no loop of blocks.
            if _can_be_non_finite(value) and not _block_is_finite(value.detach()):
                found.append(name)
            continue
        if isinstance(value, numbers.Number) and not isinstance(value, bool):
            if not cmath.isfinite(value):
                found.append(name)
        elif getattr(getattr(value, "device", None), "type", None) == "meta":
            continue  # a placeholder: its values were checked as they arrived (folded results)
        elif hasattr(value, "shape") and hasattr(value, "dtype") and _can_be_non_finite(value):
            if not all(_block_is_finite(block) for block in iter_blocks(value)):
                found.append(name)
    return found


#: Elements of the largest 1-D tensor checked in one call (as large as a block of `iter_blocks`).
_ONE_CALL_MAX = BLOCK_BYTES // 8


def _can_be_non_finite(value: Any) -> bool:
    dtype = torch_dtype_of(value)
    return dtype.is_floating_point or dtype.is_complex


def _block_is_finite(block: torch.Tensor) -> bool:
    """Whether a 1-D block holds no NaN and no infinity.

    The dot product with zeros is NaN exactly when an element is NaN or infinite (inf * 0 is
    NaN, a finite x * 0 is 0 however large x is) and runs at memory speed, several times faster
    than ``torch.isfinite(block).all()`` on CPUs, which writes a mask first. The zeros are read
    from a mapping nobody writes: they cost no memory, and no allocation per block.
    """
    if block.dtype.is_complex:
        return bool(torch.isfinite(block).all())
    if block.dtype not in (torch.float32, torch.float64):
        block = block.to(torch.float32)
    return not math.isnan(float(torch.dot(block, read_only_zeros(block.numel(), block.dtype))))


def check_finite(params: Mapping[str, Any], contributor: str) -> None:
    """Refuse ``params`` when a value holds a NaN or an infinity.

    Args:
        params: A result's values, name -> tensor, array, number or lazy reference.
        contributor: Who sent them, named in the error.

    Raises:
        ResultRefused: Some value is not finite; the message names the contributor, the first few
            values, and the setting that allows them.

    Example:
        >>> check_finite({"w": torch.tensor([1.0, float("nan")])}, "site-1")
        Traceback (most recent call last):
        ...
        engine.errors.ResultRefused: result of site-1 holds NaN or infinite values in 'w'; ...
    """
    found = non_finite_values(params)
    if found:
        raise ResultRefused(
            f"result of {contributor} holds NaN or infinite values in {_listed([repr(n) for n in found])}; "
            "set allow_non_finite = true in the workflow's args if the job expects them"
        )
