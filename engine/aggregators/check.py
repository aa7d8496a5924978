"""`check_params_match`: refuse a result whose tensors do not match the model, before aggregating it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

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
        ValueError: Names are missing or unexpected, or shapes or dtypes differ; the message
            names the contributor and the first few of each.

    Example:
        >>> check_params_match({"w": torch.zeros(2)}, {"w": torch.zeros(3)}, "site-1")
        Traceback (most recent call last):
        ...
        ValueError: result of site-1 does not match the model: 'w': shape (3,), expected (2,)
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
        raise ValueError(f"result of {contributor} does not match the model: {'; '.join(problems)}")
