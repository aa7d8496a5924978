"""Consumers: where the chunks of one download land, in whatever order they arrive.

`MemoryConsumer` places each chunk straight into preallocated tensors; `DiskConsumer` writes
the stream into a ``.safetensors`` file without parsing any tensor; `FileConsumer` writes a raw
file stream (a file-based decomposer's file). All check every chunk (index, duplicates, size)
and free what they made when the download is aborted.
"""

from __future__ import annotations

import bisect
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.errors import StreamingError
from engine.fobs.arrays import byte_view, copy_bytes
from engine.fobs.dtypes import torch_dtype
from engine.fobs.page_populator import populate_in_background
from engine.fobs.tensor_pool import pooled_take
from engine.streaming.layout import StreamLayout


class ChunkConsumer(ABC):
    """Takes the chunks of one byte stream, in any order, and builds the result.

    Args:
        total_bytes: Length of the whole stream, in bytes.
        chunk_bytes: The chunk size the stream is pulled with, in bytes (> 0).
    """

    places_on_io_thread: bool = False
    """True when ``accept`` never blocks (a copy in memory): the download then places chunks
    on the cell's I/O thread as they land. Leave False for anything that waits (disks, sleeps)."""

    def __init__(self, total_bytes: int, chunk_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk size must be > 0 bytes, got {chunk_bytes}")
        self.total_bytes = total_bytes
        self.chunk_bytes = chunk_bytes
        self.chunk_count = math.ceil(total_bytes / chunk_bytes)
        self._received: set[int] = set()

    def accept(self, index: int, frames: Sequence[Any]) -> None:
        """Take chunk ``index``, given as the frames it arrived in.

        Raises:
            StreamingError: The index is out of range or already taken, or the chunk's size is
                not the size the stream gives it.
        """
        if not 0 <= index < self.chunk_count:
            raise StreamingError(f"chunk {index} is out of range: the stream has {self.chunk_count} chunks")
        if index in self._received:
            raise StreamingError(f"chunk {index} arrived twice")
        start = index * self.chunk_bytes
        expected = min(self.chunk_bytes, self.total_bytes - start)
        pieces = [memoryview(frame).cast("B") for frame in frames]
        size = sum(piece.nbytes for piece in pieces)
        if size != expected:
            raise StreamingError(f"chunk {index} has {size} bytes, expected {expected}")
        for piece in pieces:
            self._write(start, piece)
            start += piece.nbytes
        self._received.add(index)

    def write_at(self, offset: int, piece: memoryview) -> None:
        """Put ``piece`` at byte ``offset`` of the stream, outside the chunk bookkeeping.

        For a consumer that wraps this one and keeps the chunks of its own stream (a quantized
        stream's `engine.streaming.dequantize.DequantizingConsumer`); it calls `mark_all_taken`
        once every byte is written.
        """
        self._write(offset, piece)

    def mark_all_taken(self) -> None:
        """Count every chunk as taken (the wrapping consumer wrote all the bytes with `write_at`)."""
        self._received = set(range(self.chunk_count))

    @property
    def complete(self) -> bool:
        """Whether every chunk has been taken."""
        return len(self._received) == self.chunk_count

    def missing(self) -> list[int]:
        """Indices of the chunks not taken yet."""
        return sorted(set(range(self.chunk_count)) - self._received)

    def _require_complete(self) -> None:
        if not self.complete:
            missing = self.missing()
            raise StreamingError(
                f"download incomplete: {len(missing)} of {self.chunk_count} chunks missing (first {missing[0]})"
            )

    @abstractmethod
    def _write(self, offset: int, piece: memoryview) -> None:
        """Put ``piece`` at byte ``offset`` of the stream."""

    @abstractmethod
    def finish(self) -> Any:
        """Return the result once every chunk is in (raises `StreamingError` otherwise)."""

    @abstractmethod
    def abort(self) -> None:
        """Drop everything made so far; safe to call more than once."""


class StreamConsumer(ChunkConsumer):
    """Takes the chunks of one safetensors stream and builds the result.

    Args:
        layout: The stream's layout, as received (and checked) from the sender.
        chunk_bytes: The chunk size the stream is pulled with, in bytes.
    """

    def __init__(self, layout: StreamLayout, chunk_bytes: int) -> None:
        super().__init__(layout.total_bytes, chunk_bytes)
        self.layout = layout
        self._ends = [entry.end for entry in layout.entries]

    def _entry_parts(self, offset: int, piece: memoryview) -> Iterator[tuple[int, int, memoryview]]:
        """``(entry index, offset in the entry, bytes)`` of each entry ``piece`` (at stream ``offset``) covers.

        The part of the piece that falls in the stream's header must be the header announced.

        Raises:
            StreamingError: It is not.
        """
        data_offset = offset - self.layout.data_start
        if data_offset < 0:  # the header part: already known from the reference, so it must match
            header_part = self.layout.header[offset : offset + piece.nbytes]
            if piece[: len(header_part)] != header_part:
                raise StreamingError("the streamed header differs from the one announced")
            piece, data_offset = piece[len(header_part) :], 0
        position = 0
        index = bisect.bisect_right(self._ends, data_offset)
        while position < piece.nbytes:
            entry = self.layout.entries[index]
            begin = data_offset + position - entry.begin
            count = min(entry.nbytes - begin, piece.nbytes - position)
            if count:
                yield index, begin, piece[position : position + count]
            position += count
            index += 1


class MemoryConsumer(StreamConsumer):
    """Builds a dict of CPU tensors, each allocated once and filled in place as chunks land.

    The tensors come from `engine.fobs.tensor_pool`: a download reuses the memory of an earlier
    one that is no longer in use. New memory gets its pages as this machine's page strategy says
    (`engine.fobs.page_populator`): huge pages or small ones, faulted in on background threads in
    the order the chunks will fill it, or inline as the chunks land where no core is spare.

    Args:
        layout: The stream's layout.
        chunk_bytes: The chunk size, in bytes.
        targets: Tensors of the receiver's own to fill instead, by stream name (a training
            script's parameters, `engine.client.receive` with ``into``). They are used only when
            every one of them fits its entry exactly (same shape and dtype, contiguous CPU memory
            of its own): otherwise none is, and the stream lands in new memory as without
            targets, so a mismatch is found (and named) by the caller before any byte of the
            receiver's tensors has changed. A target's tensor is what `finish` returns for it.
    """

    places_on_io_thread = True

    def __init__(
        self, layout: StreamLayout, chunk_bytes: int, targets: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        super().__init__(layout, chunk_bytes)
        self._tensors: dict[str, torch.Tensor] | None = {}
        placed = targets if targets and targets_fit(layout, targets) else {}
        #: How many entries land in the caller's own tensors (0: all in new memory).
        self.placed_count = len(placed)
        new_memory = []
        for entry in layout.entries:
            if entry.name in placed:
                self._tensors[entry.name] = placed[entry.name]
                continue
            tensor, fresh = pooled_take(entry.shape, torch_dtype(entry.dtype))
            self._tensors[entry.name] = tensor
            if fresh:
                new_memory.append(tensor)
        populate_in_background(new_memory)
        self._targets = [byte_view(self._tensors[entry.name]) for entry in layout.entries]

    def _write(self, offset: int, piece: memoryview) -> None:
        for index, begin, part in self._entry_parts(offset, piece):
            copy_bytes(self._targets[index][begin : begin + part.nbytes], part)

    def finish(self) -> dict[str, torch.Tensor]:
        self._require_complete()
        tensors, self._tensors, self._targets = self._tensors, None, []
        if tensors is None:
            raise StreamingError("the download was aborted")
        return tensors

    def abort(self) -> None:
        self._tensors, self._targets = None, []


def targets_fit(layout: StreamLayout, targets: Mapping[str, torch.Tensor]) -> bool:
    """Whether every target names an entry of ``layout`` and can take its bytes in place.

    A target fits when it is a CPU tensor of the entry's shape and dtype, contiguous, and shares
    no memory with another target (two targets on one storage would each get the other's bytes).
    """
    entries = {entry.name: entry for entry in layout.entries}
    spans: list[tuple[int, int]] = []
    for name, target in targets.items():
        entry = entries.get(name)
        if (
            entry is None
            or not isinstance(target, torch.Tensor)
            or target.device.type != "cpu"
            or not target.is_contiguous()
            or target.dtype != torch_dtype(entry.dtype)
            or tuple(target.shape) != entry.shape
            or target.requires_grad
        ):
            return False
        if target.nbytes:
            spans.append((target.data_ptr(), target.data_ptr() + target.nbytes))
    spans.sort()
    return all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))


class _FileWriter:
    """One new file written at offsets; space for all of it is reserved up front."""

    def __init__(self, path: Path, total_bytes: int) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if total_bytes:
                os.posix_fallocate(self._fd, 0, total_bytes)
        except OSError as e:
            self.abort()
            raise StreamingError(
                f"cannot reserve {total_bytes} bytes in {path.parent} for a download: {e.strerror}"
            ) from e

    def write(self, offset: int, piece: memoryview) -> None:
        if self._fd is None:
            raise StreamingError(f"the download into {self.path} was aborted")
        written = os.pwrite(self._fd, piece, offset)
        while written < piece.nbytes:  # a short write: keep going from where it stopped
            written += os.pwrite(self._fd, piece[written:], offset + written)

    def close(self) -> Path:
        if self._fd is None:
            raise StreamingError(f"the download into {self.path} was aborted")
        os.close(self._fd)
        self._fd = None
        return self.path

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)


class DiskConsumer(StreamConsumer):
    """Writes the stream into one ``.safetensors`` file; nothing is parsed but the header.

    Args:
        layout: The stream's layout.
        chunk_bytes: The chunk size, in bytes.
        path: The file to create; it must not exist. Space for the whole file is reserved up
            front, so a full disk fails the download at once, naming the folder and the bytes.
    """

    def __init__(self, layout: StreamLayout, chunk_bytes: int, path: Path) -> None:
        super().__init__(layout, chunk_bytes)
        self.path = path
        self._file = _FileWriter(path, layout.total_bytes)

    def _write(self, offset: int, piece: memoryview) -> None:
        self._file.write(offset, piece)

    def finish(self) -> Path:
        self._require_complete()
        return self._file.close()

    def abort(self) -> None:
        self._file.abort()


class FileConsumer(ChunkConsumer):
    """Writes a raw file stream into a new file, byte for byte.

    Args:
        total_bytes: The file's size as the sender announced it, in bytes.
        chunk_bytes: The chunk size, in bytes.
        path: The file to create; it must not exist. Space is reserved up front, as for
            `DiskConsumer`; an aborted download deletes it.
    """

    def __init__(self, total_bytes: int, chunk_bytes: int, path: Path) -> None:
        super().__init__(total_bytes, chunk_bytes)
        self.path = path
        self._file = _FileWriter(path, total_bytes)

    def _write(self, offset: int, piece: memoryview) -> None:
        self._file.write(offset, piece)

    def finish(self) -> Path:
        self._require_complete()
        return self._file.close()

    def abort(self) -> None:
        self._file.abort()
