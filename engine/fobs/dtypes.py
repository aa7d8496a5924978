"""Tensor dtypes by their safetensors names, the names used on the wire and in safetensors headers."""

from __future__ import annotations

import torch

from engine.errors import SerializationError

_TORCH_BY_NAME: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _name, _attr in {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
}.items():
    if hasattr(torch, _attr):  # newer dtypes, present in recent torch releases
        _TORCH_BY_NAME[_name] = getattr(torch, _attr)

_NAME_BY_TORCH = {dtype: name for name, dtype in _TORCH_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the safetensors name of a torch dtype (``torch.float32`` -> ``"F32"``).

    Raises:
        SerializationError: safetensors has no name for it.
    """
    try:
        return _NAME_BY_TORCH[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _NAME_BY_TORCH)
        raise SerializationError(f"tensors of dtype {dtype} cannot be sent (supported: {supported})") from None


def is_supported(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be sent (safetensors has a name for it)."""
    return dtype in _NAME_BY_TORCH


def torch_dtype(name: object) -> torch.dtype:
    """Return the torch dtype of a safetensors dtype name received from a peer.

    Raises:
        SerializationError: The name is not one this side can hold.
    """
    dtype = _TORCH_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise SerializationError(f"received a tensor of dtype {name!r}, which this side cannot hold")
    return dtype
