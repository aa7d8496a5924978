"""`FoldingConsumer`: a stream's tensors are handed on piece by piece, as their chunks land.

A server that folds results into a running sum needs no whole result, nor a whole tensor: each
chunk's part of a tensor is handed to a `TensorSink` as values (``fold_piece(item, first element,
values)``), and the sink is told when a tensor's last byte is in (``complete``). So a result in
flight costs one chunk-sized scratch buffer, never a model. An entry whose elements straddle
chunk boundaries (a chunk size that is not a multiple of its item size, or an entry after an
odd-sized one) is received whole into a pooled buffer first (`engine.fobs.tensor_pool`) and
handed on as one piece once complete.

The sink sees the stream's layout (names, shapes, dtypes) before the first chunk is pulled and
can refuse it there. The sink refuses by raising `ResultRefused`, which fails the download with a
`StreamingError` that says why; anything else it raises is a bug and goes up as it is. What the
sink does with a download that fails after some pieces were handed on is the sink's business (the
stream cannot take them back).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.errors import ResultRefused, StreamingError
from engine.fobs.arrays import byte_view, copy_bytes
from engine.fobs.dtypes import torch_dtype
from engine.fobs.mapped import mapped_empty
from engine.fobs.tensor_pool import pooled_empty
from engine.streaming.consumers import StreamConsumer
from engine.streaming.layout import StreamLayout

#: Stream item -> (shape, dtype): what `TensorSink.check_layout` is shown.
LayoutInfo = dict[str, tuple[tuple[int, ...], torch.dtype]]


class TensorSink(Protocol):
    """Takes the tensors of one stream as they complete."""

    def check_layout(self, layout: LayoutInfo) -> None:
        """Refuse the stream (raise `ResultRefused`) before any chunk is pulled; it names every entry."""

    def fold_piece(self, item: str, start: int, values: torch.Tensor) -> None:
        """Take elements ``start ..`` of the entry, flat (raise `ResultRefused` to refuse them: the download fails).

        Do not keep ``values``: its memory is reused for the next piece.
        """

    def complete(self, item: str) -> None:
        """Every element of the entry has been handed on (raise `ResultRefused` to refuse)."""


class FoldingConsumer(StreamConsumer):
    """Hands each chunk's values to ``sink`` as they land; a tensor is never whole unless it must be.

    `finish` returns the entries as meta tensors (shape and dtype, no memory): the values went to
    the sink. Chunks are placed on the caller's thread (the sink's work may take a while).

    Args:
        layout: The stream's layout.
        chunk_bytes: The chunk size, in bytes.
        sink: Where the values go; its `TensorSink.check_layout` runs here, before any chunk.

    Raises:
        StreamingError: The sink refused the layout (the message says why).
    """

    places_on_io_thread = False

    def __init__(self, layout: StreamLayout, chunk_bytes: int, sink: TensorSink) -> None:
        super().__init__(layout, chunk_bytes)
        self._sink = sink
        self._dtypes = [torch_dtype(entry.dtype) for entry in layout.entries]
        try:
            sink.check_layout(
                {entry.name: (entry.shape, dtype) for entry, dtype in zip(layout.entries, self._dtypes, strict=True)}
            )
        except ResultRefused as e:
            raise StreamingError(str(e)) from e
        sizes = [dtype.itemsize for dtype in self._dtypes]
        # An entry is handed on piece by piece when no element can straddle two chunks.
        self._direct = [
            chunk_bytes % size == 0 and (layout.data_start + entry.begin) % size == 0
            for entry, size in zip(layout.entries, sizes, strict=True)
        ]
        # Its own mapping: one per result and round, it would otherwise fragment the pulling
        # thread's malloc arena (see `engine.fobs.mapped`).
        self._scratch = mapped_empty(chunk_bytes if any(self._direct) else 0)
        self._scratch_bytes = byte_view(self._scratch)
        self._staged: dict[int, tuple[torch.Tensor, memoryview]] = {}
        self._filled = [0] * len(layout.entries)
        self._aborted = False
        #: Pieces handed to the sink so far.
        self.pieces = 0

    def _write(self, offset: int, piece: memoryview) -> None:
        if self._aborted:
            raise StreamingError("the download was aborted")
        for index, begin, source in self._entry_parts(offset, piece):
            if self._direct[index]:
                self._hand_on_piece(index, begin, source)
            else:
                self._stage(index, begin, source)
            self._filled[index] += source.nbytes
            if self._filled[index] == self.layout.entries[index].nbytes:
                self._complete(index)

    def _hand_on_piece(self, index: int, begin: int, source: memoryview) -> None:
        count = source.nbytes
        copy_bytes(self._scratch_bytes[:count], source)
        dtype = self._dtypes[index]
        self._call(
            self._sink.fold_piece,
            self.layout.entries[index].name,
            begin // dtype.itemsize,
            self._scratch[:count].view(dtype),
        )

    def _stage(self, index: int, begin: int, source: memoryview) -> None:
        staged = self._staged.get(index)
        if staged is None:
            entry = self.layout.entries[index]
            tensor = pooled_empty(entry.shape, self._dtypes[index])
            staged = self._staged[index] = (tensor, byte_view(tensor))
        copy_bytes(staged[1][begin : begin + source.nbytes], source)

    def _complete(self, index: int) -> None:
        name = self.layout.entries[index].name
        staged = self._staged.pop(index, None)
        if staged is not None:
            self._call(self._sink.fold_piece, name, 0, staged[0].reshape(-1))
            del staged  # back to the pool
        self._call(self._sink.complete, name)

    def _call(self, method: Any, *args: Any) -> None:
        try:
            method(*args)
        except ResultRefused as e:
            raise StreamingError(str(e)) from e
        self.pieces += 1

    def finish(self) -> dict[str, torch.Tensor]:
        self._require_complete()
        if self._aborted:
            raise StreamingError("the download was aborted")
        for entry in self.layout.entries:
            if entry.nbytes == 0:  # never written by a chunk: complete now
                self._call(self._sink.complete, entry.name)
        return {
            entry.name: torch.empty(entry.shape, dtype=dtype, device="meta")
            for entry, dtype in zip(self.layout.entries, self._dtypes, strict=True)
        }

    def abort(self) -> None:
        self._aborted = True
        self._staged = {}
