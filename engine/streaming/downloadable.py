"""`TensorDownloadable`: tensors a sender serves as one chunked safetensors stream.

Produced once, read by every receiver: the tensors are referenced, not copied. A contiguous CPU
tensor is served straight from its storage; a GPU or non-contiguous one is copied to contiguous
CPU memory when its first chunk is asked for, and kept in a small cache bounded in bytes, so
never more than about one such tensor per reader is copied at a time, never the whole model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

import torch

from engine.errors import StreamingError
from engine.fobs.arrays import tensor_bytes
from engine.streaming.layout import StreamLayout

#: Bytes of CPU copies (of GPU or non-contiguous tensors) a downloadable keeps at most.
DEFAULT_COPY_CACHE_BYTES = 256 * 1024 * 1024


class TensorDownloadable:
    """Tensors served as the chunks of one safetensors stream.

    Args:
        tensors: Name -> tensor; referenced, not copied. They must not change while served.
        chunk_bytes: Chunk size in bytes (> 0).
        metadata: Optional ``__metadata__`` of the stream (strings to strings).
        copy_cache_bytes: Bound of the cache of CPU copies, in bytes; a tensor larger than it is
            still copied (once per request that needs it), just not kept.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        chunk_bytes: int,
        metadata: Mapping[str, str] | None = None,
        copy_cache_bytes: int = DEFAULT_COPY_CACHE_BYTES,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.tensors = dict(tensors)
        self.chunk_bytes = chunk_bytes
        self.layout = StreamLayout.of_tensors(self.tensors, metadata)
        self.chunk_count = self.layout.chunk_count(chunk_bytes)
        self._copy_cache_bytes = copy_cache_bytes
        self._copies: OrderedDict[str, memoryview] = OrderedDict()
        self._copied_bytes = 0
        self._lock = threading.Lock()

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
            self._copies.clear()
            self._copied_bytes = 0

    def _data_of(self, name: str) -> memoryview:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise StreamingError("the download was released while a chunk was being served")
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            return memoryview(tensor_bytes(tensor))
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
