"""`saved_tensor_refs`: the tensors of a saved ``.safetensors`` checkpoint, read a block at a time.

An aggregator that needs the global model next to each result (norm clipping of FULL results)
would otherwise hold a second model in memory for the whole round. A `SavedTensorRef` stands for
one tensor of the checkpoint the persistor wrote (its name, shape, dtype and byte range, from the
file's header) and reads elements ``i .. j`` with one ``pread`` when asked, so the global model
costs the page cache, not the server's memory.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from engine.errors import SerializationError
from engine.fobs.dtypes import torch_dtype
from engine.fobs.tensor_layout import header_nbytes, is_header_int, shown

#: A checkpoint header larger than this is not one the persistor wrote.
MAX_HEADER_BYTES = 64 * 2**20


class SavedTensorRef:
    """One tensor of a checkpoint file: ``shape`` and ``dtype`` known, elements read on demand.

    Args:
        path: The checkpoint.
        name: The tensor's name.
        shape: Its shape.
        dtype: Its dtype.
        offset: Where its bytes start in the file.
        nbytes: How many bytes it has.
    """

    __slots__ = ("path", "name", "shape", "dtype", "offset", "nbytes")

    def __init__(self, path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype, offset: int, nbytes: int):
        self.path = path
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.offset = offset
        self.nbytes = nbytes

    def read_elements(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Read elements ``start .. start + out.numel()`` of the flattened tensor into ``out`` and return it.

        Raises:
            ValueError: ``out`` is not a contiguous tensor of this dtype, or the block lies outside the tensor.
            OSError: The file cannot be read or ends early.
        """
        if out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.dtype} tensor, got {out.dtype}")
        item = out.element_size()
        first, size = start * item, out.numel() * item
        if start < 0 or first + size > self.nbytes:
            raise ValueError(f"elements {start}..{start + out.numel()} lie outside tensor {self.name!r}")
        target = out.reshape(-1).view(torch.uint8).numpy()
        read = 0
        with open(self.path, "rb", buffering=0) as file:
            while read < size:
                count = os.preadv(file.fileno(), [target[read:]], self.offset + first + read)
                if count == 0:
                    raise OSError(f"checkpoint {self.path} ended inside tensor {self.name!r}")
                read += count
        return out

    def resolve(self) -> torch.Tensor:
        """The whole tensor, read into new memory."""
        tensor = torch.empty(self.shape, dtype=self.dtype)
        self.read_elements(0, tensor.reshape(-1))
        return tensor


def saved_tensor_refs(path: Path) -> dict[str, SavedTensorRef]:
    """A `SavedTensorRef` per tensor of the safetensors file ``path``, by name.

    Raises:
        ValueError: The file is not a well-formed safetensors file (the message names it).
        OSError: It cannot be read.
    """
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is not a safetensors file: it is shorter than its header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path} is not a safetensors file: a header of {length} bytes")
        try:
            header = json.loads(file.read(length))
        except ValueError as e:
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({e})") from e
        except RecursionError as e:
            raise ValueError(f"{path} is not a safetensors file: its header nests too deeply") from e
    size = path.stat().st_size
    data_start = 8 + length
    refs = {}
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not an object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end, shape, dtype = _read_entry(path, name, entry)
        nbytes = header_nbytes(shape, torch.empty(0, dtype=dtype).element_size())
        if nbytes is None or end - begin != nbytes or data_start + end > size:
            raise ValueError(f"{path}: tensor {name!r} does not fit the file ({begin}..{end}, {nbytes} bytes)")
        refs[name] = SavedTensorRef(path, name, shape, dtype, data_start + begin, nbytes)
    return refs


def _read_entry(path: Path, name: str, entry: object) -> tuple[int, int, tuple[int, ...], torch.dtype]:
    """The offsets, shape and dtype of one header entry, or a ValueError naming the file and the tensor."""
    if not isinstance(entry, dict) or not {"data_offsets", "shape", "dtype"} <= entry.keys():
        raise ValueError(f"{path}: tensor {name!r} has an unreadable header entry ({shown(entry)})")
    offsets, shape = entry["data_offsets"], entry["shape"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_header_int(v) for v in offsets)):
        raise ValueError(f"{path}: tensor {name!r} has invalid data_offsets {shown(offsets)}")
    if not (isinstance(shape, list) and all(is_header_int(v) for v in shape)):
        raise ValueError(f"{path}: tensor {name!r} has an invalid shape {shown(shape)}")
    try:
        dtype = torch_dtype(entry["dtype"])
    except SerializationError as e:
        raise ValueError(f"{path}: tensor {name!r}: {e}") from e
    return offsets[0], offsets[1], tuple(shape), dtype
