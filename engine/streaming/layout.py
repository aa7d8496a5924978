"""The byte layout of a tensor download: one safetensors file, served in chunks without copies.

A downloadable's byte stream is a safetensors file of the same tensors (see
`engine.fobs.tensor_layout`): an 8-byte little-endian header length, a JSON header (dtype, shape
and data offsets per tensor, space-padded to 8 bytes), then each tensor's raw bytes. So a
receiver can write the stream to disk as a ``.safetensors`` file, or place each chunk straight
into preallocated tensors. A chunk is a byte range of that stream; the sender serves it as
memoryviews into the header and the tensors' own storage.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.errors import StreamingError
from engine.fobs.dtypes import torch_dtype
from engine.fobs.tensor_layout import (
    LENGTH_PREFIX,
    MAX_HEADER_INT,
    METADATA_KEY,
    TensorEntry,
    encode_header,
    header_nbytes,
    is_header_int,
    lay_out,
    shown,
)

#: A received header larger than this is refused unread (safetensors uses the same bound).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class StreamLayout:
    """The safetensors layout of a set of tensors: header bytes and each tensor's data range.

    Attributes:
        header: The length prefix and the JSON header, as they start the stream.
        entries: The tensors in stream order.
        metadata: The header's ``__metadata__`` (string to string), if any.
    """

    header: bytes
    entries: tuple[TensorEntry, ...]
    metadata: Mapping[str, str] | None = None

    @property
    def data_start(self) -> int:
        """Offset of the data section in the stream."""
        return len(self.header)

    @property
    def total_bytes(self) -> int:
        """Length of the whole stream (a valid ``.safetensors`` file of this size)."""
        return self.data_start + (self.entries[-1].end if self.entries else 0)

    def chunk_count(self, chunk_bytes: int) -> int:
        """Number of chunks of ``chunk_bytes`` that cover the stream."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk size must be > 0 bytes, got {chunk_bytes}")
        return math.ceil(self.total_bytes / chunk_bytes)

    @classmethod
    def of_tensors(cls, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> StreamLayout:
        """Lay out ``tensors`` as safetensors would (by alignment, then name).

        Raises:
            SerializationError: A tensor's dtype has no safetensors name.
        """
        entries = lay_out(tensors)
        return cls(encode_header(entries, metadata), entries, metadata)

    @classmethod
    def parse(cls, header: bytes, max_header_bytes: int = MAX_HEADER_BYTES) -> StreamLayout:
        """Parse and check a header received from a peer; a header that lies is refused.

        Args:
            header: The length prefix and the JSON header, exactly.
            max_header_bytes: Larger headers are refused before they are read.

        Raises:
            StreamingError: The header is malformed, too large, or describes tensors whose
                sizes, offsets or dtypes do not add up.
        """
        if len(header) < LENGTH_PREFIX.size:
            raise StreamingError("safetensors header is shorter than its 8-byte length prefix")
        (length,) = LENGTH_PREFIX.unpack_from(header)
        if length > max_header_bytes:
            raise StreamingError(f"safetensors header of {length} bytes exceeds the limit of {max_header_bytes} bytes")
        if len(header) != LENGTH_PREFIX.size + length:
            raise StreamingError(f"safetensors header says {length} bytes but {len(header) - 8} arrived")
        try:
            fields = json.loads(bytes(header[LENGTH_PREFIX.size :]), object_pairs_hook=_refuse_duplicate_keys)
        except (ValueError, UnicodeDecodeError) as e:
            raise StreamingError(f"safetensors header is not valid JSON: {e}") from e
        except RecursionError as e:
            raise StreamingError("safetensors header nests lists or objects too deeply to be a header") from e
        if not isinstance(fields, dict):
            raise StreamingError("safetensors header must be a JSON object")
        metadata = fields.pop(METADATA_KEY, None)
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        ):
            raise StreamingError("safetensors __metadata__ must map strings to strings")
        entries = sorted((_parse_entry(name, spec) for name, spec in fields.items()), key=lambda e: (e.begin, e.end))
        _check_contiguous(entries)
        return cls(bytes(header), tuple(entries), metadata)

    @functools.cached_property
    def _entry_ends(self) -> list[int]:
        return [entry.end for entry in self.entries]

    def chunk(self, index: int, chunk_bytes: int, data_of: Callable[[str], memoryview]) -> list[memoryview]:
        """Return the bytes of chunk ``index`` as memoryviews, without copying them.

        Args:
            index: Which chunk, from 0.
            chunk_bytes: Chunk size in bytes.
            data_of: Returns a tensor's raw bytes by name, e.g. a view of a contiguous CPU
                tensor (see `engine.fobs.arrays.tensor_bytes`), or anything whose byte slices
                are memoryviews (a quantized tensor's records, made per slice); the caller decides
                whether a GPU or non-contiguous tensor's copy is cached while its chunks are served.

        Raises:
            IndexError: ``index`` is not a chunk of this stream.
        """
        start, stop = index * chunk_bytes, min((index + 1) * chunk_bytes, self.total_bytes)
        if index < 0 or start >= self.total_bytes:
            raise IndexError(f"chunk {index} is out of range: the stream has {self.chunk_count(chunk_bytes)} chunks")
        pieces = []
        if start < self.data_start:
            pieces.append(memoryview(self.header)[start : min(stop, self.data_start)])
        data_start, data_stop = max(start - self.data_start, 0), stop - self.data_start
        first = bisect.bisect_right(self._entry_ends, data_start)
        for entry in self.entries[first:]:
            if entry.begin >= data_stop:
                break
            if entry.nbytes == 0:
                continue
            raw = data_of(entry.name)
            pieces.append(raw[max(data_start - entry.begin, 0) : min(data_stop, entry.end) - entry.begin])
        return pieces


def _refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = {}
    for key, value in pairs:
        if key in result:
            raise StreamingError(f"safetensors header names {key!r} twice")
        result[key] = value
    return result


def _parse_entry(name: str, spec: object) -> TensorEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise StreamingError(f"tensor {name!r}: expected dtype, shape and data_offsets")
    try:
        itemsize = torch.empty((), dtype=torch_dtype(spec["dtype"])).element_size()
    except Exception as e:
        raise StreamingError(f"tensor {name!r}: {e}") from e
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(is_header_int(n) for n in shape):
        raise StreamingError(f"tensor {name!r}: invalid shape {shown(shape)} (dims are integers 0 .. 2**64 - 1)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_header_int(n) for n in offsets)):
        raise StreamingError(f"tensor {name!r}: invalid data_offsets {shown(offsets)}")
    begin, end = offsets
    expected = header_nbytes(shape, itemsize)
    if expected is None:
        raise StreamingError(f"tensor {name!r}: shape {shown(shape)} holds more than {MAX_HEADER_INT} bytes")
    if end - begin != expected:
        raise StreamingError(
            f"tensor {name!r}: shape {shown(shape)} of {spec['dtype']} needs {expected} bytes, "
            f"offsets give {end - begin}"
        )
    return TensorEntry(name, spec["dtype"], tuple(shape), begin, end)


def _check_contiguous(entries: list[TensorEntry]) -> None:
    position = 0
    for entry in entries:
        if entry.begin < position:
            raise StreamingError(
                f"tensor {entry.name!r} overlaps the tensor before it (offset {entry.begin} < {position})"
            )
        if entry.begin > position:
            raise StreamingError(f"tensor {entry.name!r} leaves a gap in the data (offset {entry.begin} > {position})")
        position = entry.end
