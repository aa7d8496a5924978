"""Where tensors' bytes sit in a safetensors byte stream, and the header that says so.

A safetensors file is an 8-byte little-endian header length, a JSON header (dtype, shape and
data offsets per tensor, space-padded to 8 bytes), then each tensor's raw bytes. The streaming
layer serves this stream in chunks; the persistors write it to disk. Tensors are laid out
largest alignment first, then by name (``safetensors.torch.save`` also sorts by dtype within one
alignment; readers accept any order).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.fobs.dtypes import dtype_name

#: The header's length prefix: 8 bytes, little-endian.
LENGTH_PREFIX = struct.Struct("<Q")
#: The header key of the string-to-string metadata.
METADATA_KEY = "__metadata__"
#: Largest dimension, offset or size a header may give: safetensors stores them as u64.
MAX_HEADER_INT = 2**64 - 1


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit in the stream.

    Attributes:
        name: The tensor's key in the state dict.
        dtype: safetensors dtype name, e.g. ``"F32"``.
        shape: The tensor's shape.
        begin: Offset of its first byte in the data section (after the header).
        end: Offset one past its last byte in the data section.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.begin


def lay_out(tensors: Mapping[str, torch.Tensor]) -> tuple[TensorEntry, ...]:
    """The entries of ``tensors`` in stream order (by alignment, then name), back to back.

    Raises:
        SerializationError: A tensor's dtype has no safetensors name.
    """
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
    entries, offset = [], 0
    for name, tensor in ordered:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, offset + nbytes))
        offset += nbytes
    return tuple(entries)


def encode_header(entries: tuple[TensorEntry, ...], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and JSON header that describe ``entries`` (and ``metadata``, if any)."""
    fields: dict[str, object] = {}
    if metadata:
        fields[METADATA_KEY] = dict(metadata)
    for entry in entries:
        fields[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
        }
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads so the data section starts 8-aligned
    return LENGTH_PREFIX.pack(len(text)) + text


def is_header_int(value: object) -> bool:
    """Whether ``value`` can be a dimension, offset or size in a header: an int in ``0 .. 2**64 - 1``."""
    return type(value) is int and 0 <= value <= MAX_HEADER_INT


def header_nbytes(shape: Sequence[int], itemsize: int) -> int | None:
    """Bytes of a tensor of ``shape`` (dims already checked with `is_header_int`), or None past 2**64 - 1.

    Multiplied one dim at a time and stopped as soon as it passes the bound: a received header
    may list millions of dims, and their full product would have millions of digits.
    """
    if 0 in shape:
        return 0
    total = itemsize
    for dim in shape:
        total *= dim
        if total > MAX_HEADER_INT:
            return None
    return total


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about received headers."""
    if isinstance(value, list) and len(value) > limit:
        value = value[:limit]  # never repr a list of millions of items only to cut it
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
