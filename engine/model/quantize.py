"""A message's model params marked to travel quantized (`engine.fobs.quantized`), the message itself unchanged."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from engine.errors import SerializationError
from engine.fobs.quantized import FP16_MAX, LOGICAL_DTYPES, QuantizedTensor, codec_of
from engine.model.dxo import DXO
from engine.model.fl_model import FLModel
from engine.model.shareable import Shareable


def quantized_params(params: dict[str, Any], mode: str, min_numel: int = 0) -> dict[str, Any]:
    """A new dict of ``params`` with each float tensor (or array) of ``min_numel`` values or more quantized.

    Other values (integer buffers, small tensors, lazy values on disk) stay as they are.

    Raises:
        SerializationError: The mode is unknown, or (``fp16``) a tensor holds values beyond
            float16's range; the message names the tensor and the modes that would fit.
    """
    codec_of(mode)
    marked = {}
    for name, value in params.items():
        tensor, as_numpy = value, False
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            tensor, as_numpy = torch.from_numpy(value), True
        if isinstance(tensor, torch.Tensor) and tensor.dtype in LOGICAL_DTYPES.values() and tensor.numel() >= min_numel:
            if mode == "fp16" and _largest_magnitude(tensor) > FP16_MAX:
                raise SerializationError(
                    f"param {name!r} holds values beyond float16's range (+-{FP16_MAX:g}); quantize it with "
                    "mode bf16 or int8, which keep float32's range"
                )
            marked[name] = QuantizedTensor(tensor, mode, as_numpy)
        else:
            marked[name] = value
    return marked


def _largest_magnitude(tensor: torch.Tensor) -> float:
    """max |x| of ``tensor`` without a temporary the size of the tensor (``abs()`` would make one)."""
    if not tensor.numel():
        return 0.0
    low, high = torch.aminmax(tensor.detach())
    return max(-float(low), float(high))


def quantized_copy(shareable: Shareable, mode: str, min_numel: int = 0) -> Shareable:
    """A copy of ``shareable`` whose model params (`FLModel` or DXO) travel quantized.

    The copy shares every value with ``shareable`` but the params dict, so ``shareable`` is left
    as it was (a sender may go on using its model). A shareable without params is returned as it is.

    Raises:
        SerializationError: As `quantized_params`.
    """
    copy = Shareable(shareable)
    changed = False
    for key, value in copy.items():
        if isinstance(value, FLModel) and value.params:
            copy[key] = dataclasses.replace(value, params=quantized_params(value.params, mode, min_numel))
            changed = True
        elif isinstance(value, DXO) and value.data:
            copy[key] = dataclasses.replace(value, data=quantized_params(value.data, mode, min_numel))
            changed = True
    return copy if changed else shareable
