"""Native decomposers for numpy arrays and torch tensors: their memory travels as one datum each.

These are the inline path (chunk size 0). The streaming layer registers via-downloader
decomposers in their place when a job streams tensors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from engine.errors import SerializationError
from engine.fobs.context import DecodeContext, EncodeContext
from engine.fobs.datum import Datum, DatumType
from engine.fobs.decomposer import Decomposer
from engine.fobs.dtypes import dtype_name, torch_dtype
from engine.fobs.tensor_pool import pooled_empty

#: numpy dtype kinds that are plain bytes in memory: bool, ints, floats, complex, bytes, str.
_PLAIN_NUMPY_KINDS = frozenset("biufcSU")


def numpy_dtype(text: object) -> np.dtype:
    """Parse a numpy dtype string received from a peer, refusing object and structured dtypes."""
    try:
        dtype = np.dtype(text) if isinstance(text, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _PLAIN_NUMPY_KINDS:
        raise SerializationError(f"received an array of dtype {text!r}, which this side does not rebuild")
    return dtype


def check_shape(shape: object, itemsize: int, nbytes: int) -> tuple[int, ...]:
    """Check a received shape against the bytes that arrived for it."""
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise SerializationError(f"received an invalid shape {shape!r}")
    expected = math.prod(shape) * itemsize
    if expected != nbytes:
        raise SerializationError(f"shape {shape} needs {expected} bytes but {nbytes} arrived")
    return tuple(shape)


class NumpyArrayDecomposer(Decomposer[np.ndarray]):
    """numpy arrays: dtype and shape in the body, memory as one datum (no copy if contiguous).

    Received arrays are writable copies of the frame, so a training script may change them.
    """

    def supported_type(self) -> type[np.ndarray]:
        return np.ndarray

    def decompose(self, obj: np.ndarray, ctx: EncodeContext) -> Any:
        if obj.dtype.kind not in _PLAIN_NUMPY_KINDS:
            raise SerializationError(f"numpy arrays of dtype {obj.dtype} cannot be sent; convert to a numeric dtype")
        array = np.ascontiguousarray(obj)
        data = array.reshape(-1).view(np.uint8)
        return {"dtype": array.dtype.str, "shape": list(array.shape), "data": Datum(data, DatumType.ARRAY_BYTES)}

    def recompose(self, data: Any, ctx: DecodeContext) -> np.ndarray:
        dtype = numpy_dtype(data["dtype"])
        frame = memoryview(data["data"])
        shape = check_shape(data["shape"], dtype.itemsize, frame.nbytes)
        return np.frombuffer(frame, dtype=dtype).reshape(shape).copy()


class NumpyScalarDecomposer(Decomposer[np.generic]):
    """numpy scalars (``np.float32(0.5)``, often found in metrics), rebuilt with their exact dtype."""

    covers_subclasses = True

    def supported_type(self) -> type[np.generic]:
        return np.generic

    def decompose(self, obj: np.generic, ctx: EncodeContext) -> Any:
        if obj.dtype.kind not in _PLAIN_NUMPY_KINDS:
            raise SerializationError(f"numpy scalars of dtype {obj.dtype} cannot be sent")
        return {"dtype": obj.dtype.str, "data": obj.tobytes()}

    def recompose(self, data: Any, ctx: DecodeContext) -> np.generic:
        dtype = numpy_dtype(data["dtype"])
        raw = data["data"]
        check_shape([], dtype.itemsize, len(raw))
        return np.frombuffer(raw, dtype=dtype)[0]


class TensorDecomposer(Decomposer[torch.Tensor]):
    """torch tensors: safetensors dtype name and shape in the body, memory as one datum.

    A GPU or non-contiguous tensor is copied to contiguous CPU memory, one tensor at a time.
    Received tensors are writable CPU tensors (a copy of the frame); ``nn.Parameter`` and other
    subclasses are sent as plain tensors.
    """

    covers_subclasses = True

    def supported_type(self) -> type[torch.Tensor]:
        return torch.Tensor

    def decompose(self, obj: torch.Tensor, ctx: EncodeContext) -> Any:
        return {
            "dtype": dtype_name(obj.dtype),
            "shape": list(obj.shape),
            "data": Datum(tensor_bytes(obj), DatumType.TENSOR_BYTES),
        }

    def recompose(self, data: Any, ctx: DecodeContext) -> torch.Tensor:
        dtype = torch_dtype(data["dtype"])
        frame = memoryview(data["data"])
        shape = check_shape(data["shape"], torch.empty((), dtype=dtype).element_size(), frame.nbytes)
        tensor = pooled_empty(shape, dtype)
        if frame.nbytes:
            copy_bytes(byte_view(tensor), frame)
        return tensor


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a flat, writable uint8 numpy array (a view, no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def copy_bytes(target: np.ndarray, source: Any) -> None:
    """Copy the buffer ``source`` into the uint8 array ``target`` of the same length.

    The copy runs on the calling thread with the GIL released. Not ``Tensor.copy_``: torch
    splits a large copy over its intra-op threads, which then spin waiting for more work and
    take the cores that the network threads of a download need (a 1 GiB download spent 1.0 s
    more CPU and ran a third slower that way on a 2-core machine).
    """
    np.copyto(target, np.frombuffer(source, dtype=np.uint8))


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """Return a tensor's memory as a flat uint8 numpy array (a view when it is contiguous on the CPU).

    Raises:
        SerializationError: A sparse, quantized or otherwise non-strided tensor.
    """
    if tensor.layout is not torch.strided or tensor.is_quantized:
        raise SerializationError(f"{tensor.layout} tensors cannot be sent; call .to_dense() first")
    dtype_name(tensor.dtype)  # refuse unsupported dtypes with a clear message
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()
