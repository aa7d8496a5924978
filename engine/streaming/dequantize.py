"""Receiving a quantized stream: each landed range becomes values before any consumer sees it.

A stream whose ``__metadata__`` lists quantized entries (`engine.fobs.quantized`) is pulled as
it was sent, but its consumer (memory, disk, the folding sum, a script's own tensors) is built
for the *logical* stream: the same entries in their own dtypes and shapes, as if nothing had been
quantized. `DequantizingConsumer` sits between the two. It takes the wire chunks in any order,
decodes every whole record at once, keeps the few records that straddle two chunks until their
other part lands, and writes the values at their place in the logical stream. So a quantized
download costs the receiver what a plain one does, plus a record or two per chunk.

Everything in the metadata is checked against the wire layout before a byte is reserved: the
entries it names exist, have the wire dtype of their mode and exactly the bytes their logical
shape needs, and the logical dtype is a float one. The logical size is what a budget is charged.
Whatever chunk size the sender gives, values are decoded and handed on `DECODE_SLICE_BYTES` of
wire at a time, so the receiver's scratch never grows with it; a plain (unquantized) entry of
such a stream is handed on in whole elements, as a consumer of the logical stream expects.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import SerializationError, StreamingError
from engine.fobs.dtypes import torch_dtype
from engine.fobs.quantized import LOGICAL_DTYPES, QUANTIZED_METADATA_KEY, WireCodec, codec_of, convert
from engine.fobs.tensor_layout import TensorEntry, header_nbytes, is_header_int, shown
from engine.streaming.consumers import StreamConsumer
from engine.streaming.layout import StreamLayout

#: Wire bytes decoded (or, for a plain entry, handed on) in one piece: a sender whose chunks are
#: larger (its say, up to the cell's message size) costs the receiver no larger scratch.
DECODE_SLICE_BYTES = 1 << 20
#: The largest tensor torch can make, in bytes (its sizes are signed 64-bit).
_TORCH_MAX_BYTES = 2**63 - 1


@dataclass(frozen=True)
class Dequantized:
    """How one quantized entry is decoded: its codec, its own shape and dtype."""

    codec: WireCodec
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class DequantizePlan:
    """A quantized stream's logical layout and how each of its quantized entries is decoded.

    Attributes:
        logical: The stream as if nothing had been quantized (what the consumer is built for).
        entries: Quantized entry name -> how it is decoded.
    """

    logical: StreamLayout
    entries: Mapping[str, Dequantized]

    def logical_chunk_bytes(self, chunk_bytes: int) -> int:
        """The largest piece of the logical stream that `DequantizingConsumer` writes at once.

        What one wire chunk (at most `DECODE_SLICE_BYTES` of it: larger chunks are decoded a
        slice at a time) or one record turns into; never more than the logical stream.
        """
        growth, record_values = 1, 0
        for plan in self.entries.values():
            itemsize = plan.dtype.itemsize
            growth = max(growth, math.ceil(itemsize * 8 / plan.codec.bits))
            record_values = max(record_values, plan.codec.values_per_record * itemsize)
        wire_piece = min(chunk_bytes, DECODE_SLICE_BYTES)
        size = min(max(wire_piece * growth, record_values), self.logical.total_bytes)
        return max(size + (-size % 8), 8)


def plan_of(layout: StreamLayout) -> DequantizePlan | None:
    """The `DequantizePlan` of a received layout; None when nothing in it is quantized.

    Raises:
        StreamingError: The metadata is malformed or does not match the entries it names.
    """
    listed = (layout.metadata or {}).get(QUANTIZED_METADATA_KEY)
    if listed is None:
        return None
    try:
        named = json.loads(listed)
    except (ValueError, RecursionError) as e:
        raise StreamingError(f"the stream's list of quantized entries is not valid JSON: {e}") from e
    if not isinstance(named, dict) or not named:
        raise StreamingError("the stream's list of quantized entries must be a non-empty JSON object")
    wire = {entry.name: entry for entry in layout.entries}
    plans: dict[str, Dequantized] = {}
    for name, spec in named.items():
        plans[name] = _plan_of_entry(name, spec, wire.get(name))
    logical_meta = {}
    for entry in layout.entries:
        plan = plans.get(entry.name)
        shape, dtype = (plan.shape, plan.dtype) if plan else (entry.shape, torch_dtype(entry.dtype))
        logical_meta[entry.name] = _placeholder(entry.name, shape, dtype)
    metadata = {key: value for key, value in (layout.metadata or {}).items() if key != QUANTIZED_METADATA_KEY}
    return DequantizePlan(StreamLayout.of_tensors(logical_meta, metadata or None), plans)


def _plan_of_entry(name: str, spec: object, entry: TensorEntry | None) -> Dequantized:
    where = f"quantized entry {shown(name)}"
    if entry is None:
        raise StreamingError(f"{where}: the stream has no such entry")
    if not (isinstance(spec, list) and len(spec) == 3):
        raise StreamingError(f"{where}: expected [mode, dtype, shape], got {str(spec)[:80]}")
    mode, dtype_name, shape = spec
    try:
        codec = codec_of(mode)
    except SerializationError as e:
        raise StreamingError(f"{where}: {e}") from e
    dtype = LOGICAL_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise StreamingError(f"{where}: dtype {str(dtype_name)[:20]!r} is not one a tensor is quantized from")
    if not (isinstance(shape, list) and all(is_header_int(n) for n in shape)):
        raise StreamingError(f"{where}: invalid shape {shown(shape)}")
    if entry.dtype != codec.wire_dtype:
        raise StreamingError(f"{where}: {mode} travels as {codec.wire_dtype}, the stream says {entry.dtype}")
    # Multiplied with a bound, never in full: a hostile shape may list millions of dims.
    numel = header_nbytes(shape, 1)
    if numel is None or codec.wire_nbytes(numel) != entry.nbytes:
        values = "more than 2**64 - 1" if numel is None else str(numel)
        needs = "" if numel is None else f" take {codec.wire_nbytes(numel)} bytes,"
        raise StreamingError(f"{where}: {values} values in {mode}{needs} the stream gives {entry.nbytes} bytes")
    return Dequantized(codec, tuple(shape), dtype, numel)


def _placeholder(name: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of the logical layout; refused (never raised by torch) where torch cannot hold it."""
    nbytes = header_nbytes(shape, dtype.itemsize)
    if nbytes is None or nbytes > _TORCH_MAX_BYTES:
        raise StreamingError(f"entry {shown(name)}: shape {shown(list(shape))} of {dtype} is larger than any tensor")
    return torch.empty(shape, dtype=dtype, device="meta")


class DequantizingConsumer(StreamConsumer):
    """Takes a quantized stream's chunks and writes the values into a consumer of the logical stream.

    Args:
        wire: The stream's layout as received.
        chunk_bytes: The wire stream's chunk size, in bytes.
        plan: Its `DequantizePlan` (`plan_of`).
        inner: A consumer built for ``plan.logical`` (with ``plan.logical_chunk_bytes(chunk_bytes)``).
    """

    def __init__(self, wire: StreamLayout, chunk_bytes: int, plan: DequantizePlan, inner: StreamConsumer) -> None:
        super().__init__(wire, chunk_bytes)
        # Decoding takes a few ms per chunk: done on the pulling thread, never the cell's I/O thread.
        self.places_on_io_thread = False
        self._inner = inner
        logical = {entry.name: entry for entry in plan.logical.entries}
        self._logical_start = plan.logical.data_start
        self._targets = [(logical[entry.name], plan.entries.get(entry.name)) for entry in wire.entries]
        self._itemsizes = [torch_dtype(entry.dtype).itemsize for entry in wire.entries]
        self._straddling: dict[tuple[int, int], tuple[bytearray, int]] = {}
        self._wire_scratch: np.ndarray | None = None
        self._decoded: torch.Tensor | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        inner.write_at(0, memoryview(plan.logical.header))

    def _write(self, offset: int, piece: memoryview) -> None:
        for index, begin, part in self._entry_parts(offset, piece):
            self._take(index, begin, part)

    def _record_bytes(self, index: int) -> int:
        """Bytes of a record of wire entry ``index``: a quantized record, or one element of a plain entry."""
        plan = self._targets[index][1]
        return plan.codec.record_bytes if plan is not None else self._itemsizes[index]

    def _span(self, index: int, record: int) -> tuple[int, int]:
        """Where record ``record`` of wire entry ``index`` begins and ends in the entry."""
        plan = self._targets[index][1]
        if plan is None:
            itemsize = self._itemsizes[index]
            return record * itemsize, (record + 1) * itemsize
        return plan.codec.record_span(record, plan.numel)

    def _take(self, index: int, begin: int, part: memoryview) -> None:
        """Bytes ``[begin, begin + len(part))`` of wire entry ``index``."""
        record_bytes, end = self._record_bytes(index), begin + part.nbytes
        first, last = begin // record_bytes, (end - 1) // record_bytes
        whole_from = first if begin == self._span(index, first)[0] else first + 1
        whole_to = last if self._span(index, last)[1] == end else last - 1
        per_call = max(1, DECODE_SLICE_BYTES // record_bytes)
        for record in range(whole_from, whole_to + 1, per_call):
            count = min(per_call, whole_to + 1 - record)
            start, stop = self._span(index, record)[0], self._span(index, record + count - 1)[1]
            self._whole(index, record, part[start - begin : stop - begin], count)
        edges = {first, last} - ({whole_from, whole_to} if whole_from <= whole_to else set())
        for record in edges:  # the records only partly in this part (at most one at each end)
            span_begin, span_end = self._span(index, record)
            low, high = max(span_begin, begin), min(span_end, end)
            self._straddle(index, record, low - span_begin, part[low - begin : high - begin], span_end - span_begin)

    def _straddle(self, index: int, record: int, at: int, part: memoryview, size: int) -> None:
        """Part of a record that straddles two chunks; handed on once all of it is in."""
        buffer, filled = self._straddling.get((index, record), (None, 0))
        if buffer is None:
            buffer = bytearray(size)
        buffer[at : at + part.nbytes] = part
        filled += part.nbytes
        if filled < size:
            self._straddling[(index, record)] = (buffer, filled)
            return
        self._straddling.pop((index, record), None)
        self._whole(index, record, memoryview(buffer), 1)

    def _whole(self, index: int, record: int, records: memoryview, count: int) -> None:
        """``count`` whole records from ``record`` on, written in place as values."""
        logical, plan = self._targets[index]
        if plan is None:  # not quantized: as it came, in whole elements
            where = self._logical_start + logical.begin + record * self._itemsizes[index]
            self._inner.write_at(where, records)
            return
        codec = plan.codec
        first_value = record * codec.values_per_record
        numel = min((record + count) * codec.values_per_record, plan.numel) - first_value
        if self._decoded is None:  # made once per download and reused: chunks never fragment the heap
            codecs = [p.codec for _, p in self._targets if p is not None]
            # The most wire bytes one call decodes, and the most values they hold (int4: two a byte).
            wire_piece = min(self.chunk_bytes, self.total_bytes, DECODE_SLICE_BYTES)  # chunks: the sender's say
            largest = max(wire_piece, *(c.record_bytes for c in codecs))
            values = max(-(-largest * 8 // min(c.bits for c in codecs)), *(c.values_per_record for c in codecs))
            self._wire_scratch = np.empty(largest, dtype=np.uint8)
            self._decoded = torch.empty(values, dtype=torch.float32)
        try:
            values = codec.decode(records, numel, self._decoded, self._wire_scratch)
        except SerializationError as e:
            raise StreamingError(f"tensor {logical.name!r}: {e}") from e
        if plan.dtype != torch.float32:
            typed = self._typed.get(plan.dtype)
            if typed is None:
                typed = self._typed[plan.dtype] = torch.empty(self._decoded.numel(), dtype=plan.dtype)
            convert(values, typed[:numel])
            values = typed[:numel]
        raw = memoryview(values.view(torch.uint8).numpy())
        self._inner.write_at(self._logical_start + logical.begin + first_value * plan.dtype.itemsize, raw)

    def finish(self) -> object:
        self._require_complete()
        if self._straddling:
            raise StreamingError(f"{len(self._straddling)} quantized records were never completed")
        self._inner.mark_all_taken()
        return self._inner.finish()

    def abort(self) -> None:
        self._straddling, self._typed = {}, {}
        self._wire_scratch = self._decoded = None
        self._inner.abort()
