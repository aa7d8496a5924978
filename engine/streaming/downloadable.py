"""Downloadables: what a sender serves, chunk by chunk, to every receiver of one offer.

`TensorDownloadable`: tensors as one chunked safetensors stream. Produced once, read by every
receiver: the tensors are referenced, not copied. A contiguous CPU tensor is served straight
from its storage; a GPU or non-contiguous one is copied to contiguous CPU memory when its first
chunk is asked for, and kept in a small cache bounded in bytes, so never more than about one
such tensor per reader is copied at a time, never the whole model. A `QuantizedTensor` is
served as its wire records, made for each chunk from the range it covers (never the whole
tensor), the last few kept for the offer's other receivers; the stream's ``__metadata__`` lists
such entries for the receiver.

`FileDownloadable`: the bytes of one file, read per chunk; the file is deleted when released.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.errors import StreamingError
from engine.fobs.arrays import tensor_bytes
from engine.fobs.dtypes import dtype_name
from engine.fobs.quantized import QUANTIZED_METADATA_KEY, QuantizedTensor
from engine.streaming.layout import StreamLayout

#: Bytes of CPU copies (of GPU or non-contiguous tensors) a downloadable keeps at most.
DEFAULT_COPY_CACHE_BYTES = 256 * 1024 * 1024
#: Bytes of quantized records a downloadable keeps for its other receivers (a receiver that asks
#: for a chunk shortly after another gets the same records without encoding them again).
WIRE_CACHE_BYTES = 32 * 1024 * 1024
#: ``kind`` of the info reply: what the receiver is about to pull.
KIND_TENSORS = "tensors"
KIND_FILE = "file"


class Downloadable(Protocol):
    """What the download service serves: a number of chunks, described once by an info reply."""

    chunk_bytes: int
    chunk_count: int
    #: True when every chunk is a view of memory that is ready (no copy, no disk read), so
    #: serving one never blocks.
    in_memory: bool

    def info(self) -> tuple[dict[str, Any], list[bytes]]:
        """Return the header and frames of the reply to an ``info`` request."""

    def chunk(self, index: int) -> list[memoryview]:
        """Return chunk ``index`` as buffers to send as frames."""

    def release(self) -> None:
        """Free what the downloadable holds; it serves no more."""


class TensorDownloadable:
    """Tensors served as the chunks of one safetensors stream.

    Args:
        tensors: Name -> tensor (or `QuantizedTensor`); referenced, not copied. They must not
            change while served.
        chunk_bytes: Chunk size in bytes (> 0).
        metadata: Optional ``__metadata__`` of the stream (strings to strings).
        copy_cache_bytes: Bound of the cache of CPU copies, in bytes; a tensor larger than it is
            still copied (once per request that needs it), just not kept.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor | QuantizedTensor],
        chunk_bytes: int,
        metadata: Mapping[str, str] | None = None,
        copy_cache_bytes: int = DEFAULT_COPY_CACHE_BYTES,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.tensors = dict(tensors)
        self.chunk_bytes = chunk_bytes
        quantized = {name: value for name, value in self.tensors.items() if isinstance(value, QuantizedTensor)}
        if quantized:
            listed = {name: [q.mode, dtype_name(q.tensor.dtype), list(q.tensor.shape)] for name, q in quantized.items()}
            metadata = {**(metadata or {}), QUANTIZED_METADATA_KEY: json.dumps(listed, separators=(",", ":"))}
        wire = {name: quantized[name].meta() if name in quantized else value for name, value in self.tensors.items()}
        self.layout = StreamLayout.of_tensors(wire, metadata)
        self.chunk_count = self.layout.chunk_count(chunk_bytes)
        self.in_memory = not quantized and all(_in_place(tensor) for tensor in self.tensors.values())
        self._copy_cache_bytes = copy_cache_bytes
        self._views: dict[str, memoryview] = {}  # in-place tensors' bytes, made once per tensor
        self._copies: OrderedDict[str, memoryview] = OrderedDict()
        self._copied_bytes = 0
        self._wire: OrderedDict[tuple[str, int, int], memoryview] = OrderedDict()  # recent quantized ranges
        self._wire_bytes = 0
        self._lock = threading.Lock()

    def info(self) -> tuple[dict[str, Any], list[bytes]]:
        """The info reply: kind, chunk size and count in the header, the safetensors header as a frame."""
        header = {"kind": KIND_TENSORS, "chunk_bytes": self.chunk_bytes, "chunk_count": self.chunk_count}
        return header, [self.layout.header]

    def chunk(self, index: int) -> list[memoryview]:
        """Return chunk ``index`` as buffers to send as frames (see `StreamLayout.chunk`).

        Raises:
            StreamingError: The downloadable was released (its transaction ended meanwhile).
        """
        return self.layout.chunk(index, self.chunk_bytes, self._data_of)

    def release(self) -> None:
        """Drop the references to the tensors and any copies; the downloadable serves no more."""
        with self._lock:
            self.tensors.clear()
            self._views.clear()
            self._copies.clear()
            self._copied_bytes = 0
            self._wire.clear()
            self._wire_bytes = 0

    def _data_of(self, name: str) -> memoryview | _WireRecords:
        view = self._views.get(name)
        if view is not None:
            return view
        tensor = self.tensors.get(name)
        if tensor is None:
            raise StreamingError("the download was released while a chunk was being served")
        if isinstance(tensor, QuantizedTensor):
            return _WireRecords(name, tensor, self)
        if _in_place(tensor):
            view = memoryview(tensor_bytes(tensor))
            with self._lock:
                if name in self.tensors:  # not released meanwhile: a kept view would pin the memory
                    self._views[name] = view
            return view
        with self._lock:
            cached = self._copies.get(name)
            if cached is not None:
                self._copies.move_to_end(name)
                return cached
            copy = memoryview(tensor_bytes(tensor))  # one tensor to contiguous CPU memory
            if copy.nbytes <= self._copy_cache_bytes:
                while self._copies and self._copied_bytes + copy.nbytes > self._copy_cache_bytes:
                    _, evicted = self._copies.popitem(last=False)
                    self._copied_bytes -= evicted.nbytes
                self._copies[name] = copy
                self._copied_bytes += copy.nbytes
            return copy

    def wire_range(self, name: str, tensor: QuantizedTensor, start: int, stop: int) -> memoryview:
        """Bytes ``[start, stop)`` of a quantized entry: made now, or kept from another receiver's request."""
        key = (name, start, stop)
        with self._lock:
            kept = self._wire.get(key)
            if kept is not None:
                self._wire.move_to_end(key)
                return kept
        made = tensor.wire_range(start, stop)  # outside the lock: other requests are served meanwhile
        with self._lock:
            if name in self.tensors and key not in self._wire and made.nbytes <= WIRE_CACHE_BYTES:
                while self._wire and self._wire_bytes + made.nbytes > WIRE_CACHE_BYTES:
                    _, evicted = self._wire.popitem(last=False)
                    self._wire_bytes -= evicted.nbytes
                self._wire[key] = made
                self._wire_bytes += made.nbytes
        return made


class _WireRecords:
    """A quantized tensor's wire bytes as `StreamLayout.chunk` slices them: each slice made on demand."""

    def __init__(self, name: str, tensor: QuantizedTensor, owner: TensorDownloadable) -> None:
        self._name, self._tensor, self._owner = name, tensor, owner

    def __getitem__(self, span: slice) -> memoryview:
        return self._owner.wire_range(self._name, self._tensor, span.start, span.stop)


def _in_place(tensor: torch.Tensor) -> bool:
    """Whether a tensor's bytes can be served from its own storage, without a copy."""
    return tensor.device.type == "cpu" and tensor.is_contiguous()


class FileDownloadable:
    """The bytes of one file, served as chunks read from disk as they are asked for.

    Args:
        path: The file; it must not change while served.
        chunk_bytes: Chunk size in bytes (> 0).
        owned_folder: A folder that holds only this file and is deleted with it on release
            (the sender's temp folder), or None to delete just the file.
    """

    def __init__(self, path: Path, chunk_bytes: int, owned_folder: Path | None = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.path = path
        self.chunk_bytes = chunk_bytes
        self.size_bytes = path.stat().st_size
        self.chunk_count = math.ceil(self.size_bytes / chunk_bytes)
        self.in_memory = False  # chunks are read from disk
        self._owned_folder = owned_folder
        self._released = False

    def info(self) -> tuple[dict[str, Any], list[bytes]]:
        """The info reply: a raw file stream of ``size_bytes``, no frames."""
        header = {
            "kind": KIND_FILE,
            "chunk_bytes": self.chunk_bytes,
            "chunk_count": self.chunk_count,
            "size_bytes": self.size_bytes,
        }
        return header, []

    def chunk(self, index: int) -> list[memoryview]:
        """Return bytes ``[index * chunk_bytes, ...)`` of the file, read now.

        Raises:
            StreamingError: The downloadable was released, or the file cannot be read.
        """
        offset = index * self.chunk_bytes
        size = min(self.chunk_bytes, self.size_bytes - offset)
        if self._released:
            raise StreamingError("the download was released while a chunk was being served")
        # Opened per chunk, so a release (which deletes the file) never closes a descriptor
        # another request is reading from.
        try:
            with open(self.path, "rb", buffering=0) as file:
                data = os.pread(file.fileno(), size, offset)
        except FileNotFoundError as e:
            raise StreamingError("the download was released while a chunk was being served") from e
        except OSError as e:
            raise StreamingError(f"cannot read chunk {index} of {self.path}: {e.strerror}") from e
        if len(data) != size:
            raise StreamingError(f"{self.path} changed while served: chunk {index} has {len(data)} of {size} bytes")
        return [memoryview(data)]

    def release(self) -> None:
        """Delete the file (and its owned folder); safe to call more than once."""
        self._released = True
        if self._owned_folder is not None:
            shutil.rmtree(self._owned_folder, ignore_errors=True)
        else:
            self.path.unlink(missing_ok=True)
