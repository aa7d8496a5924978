"""Quantized tensors on the wire: fp16, bf16, or 8- or 4-bit blockwise bytes, made and read a range at a time.

A `QuantizedTensor` stands for a float tensor that is to travel in fewer bytes. Its wire bytes
are never made whole: the sender makes the bytes of the range a chunk asks for (`wire_range`),
the receiver turns each landed range back into values (`WireCodec.decode`), so neither side
holds a second copy of the model, only a chunk's worth.

The wire format of one tensor is a sequence of *records*, each decodable on its own:

- ``fp16`` / ``bf16``: one 2-byte value per record (IEEE half, or bfloat16: float32's
  exponent range, 8 bits of mantissa).
- ``int8``: a record holds a block of up to `INT8_BLOCK` values: a little-endian float32 scale
  (the block's largest magnitude / 127) then one signed byte per value (``round(v / scale)``).
  4 + 4092 = 4096 bytes, so a record never straddles a chunk whose size is a multiple of 4 KiB
  (the usual 2 MiB chunks) unless the stream's layout shifts it; a straddling record is put
  together by the receiver before it is decoded.
- ``int4``: the same with 15 levels (scale = largest magnitude / 7), two values a byte (the
  first in the low nibble, each stored as ``q + 8``): `INT4_BLOCK` = 8,184 values, 4 KiB a record.

The error a mode allows, relative to the values of a tensor (or of a block, for int8 and int4),
is `max_relative_error`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import SerializationError
from engine.fobs.arrays import copy_bytes

#: Values per record of the ``int8`` mode (with the 4-byte scale, a record is 4 KiB).
INT8_BLOCK = 4092
#: Values per record of the ``int4`` mode (two a byte; with the scale, a record is 4 KiB).
INT4_BLOCK = 8184
#: Safetensors ``__metadata__`` key that lists a stream's quantized entries (a JSON object:
#: entry name -> ``[mode, logical dtype name, logical shape]``).
QUANTIZED_METADATA_KEY = "flengine.quantized"
#: The largest magnitude float16 can hold; a tensor beyond it is refused in ``fp16`` mode.
FP16_MAX = 65504.0
#: The dtypes a quantized tensor may have, by their safetensors names.
LOGICAL_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class WireCodec:
    """How one mode turns values into records and back.

    Attributes:
        mode: ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"int4"``.
        wire_dtype: The safetensors dtype of the wire entry (``"F16"``, ``"BF16"``, ``"U8"``).
        values_per_record: Values one full record holds.
        record_bytes: Bytes of one full record (the last record of a tensor may be shorter).
        max_relative_error: The largest error of a decoded value relative to the largest
            magnitude of its tensor (fp16 / bf16, rounding) or of its block (int8, int4).
        bits: Bits of one value on the wire.
        levels: For the blockwise modes, the largest quantized magnitude (127, 7); 0 otherwise.
    """

    mode: str
    wire_dtype: str
    values_per_record: int
    record_bytes: int
    max_relative_error: float
    bits: int
    levels: int = 0

    @property
    def header_bytes(self) -> int:
        """Bytes of a record before its values (the blockwise modes' scale)."""
        return self.record_bytes - self.value_nbytes(self.values_per_record)

    def value_nbytes(self, count: int) -> int:
        """Bytes that ``count`` values take in a record."""
        return -(-count * self.bits // 8)

    def wire_nbytes(self, numel: int) -> int:
        """Bytes of the wire entry of a tensor of ``numel`` values."""
        full, rest = divmod(numel, self.values_per_record)
        return full * self.record_bytes + (self.header_bytes + self.value_nbytes(rest) if rest else 0)

    def record_count(self, numel: int) -> int:
        """Records of a tensor of ``numel`` values."""
        return math.ceil(numel / self.values_per_record)

    def record_span(self, record: int, numel: int) -> tuple[int, int]:
        """Bytes ``[begin, end)`` of ``record`` in the wire entry of a tensor of ``numel`` values."""
        begin = record * self.record_bytes
        values = min(self.values_per_record, numel - record * self.values_per_record)
        return begin, begin + self.header_bytes + self.value_nbytes(values)

    def encode(self, values: torch.Tensor) -> np.ndarray:
        """The records of ``values`` (flat, starting at a record boundary), as a uint8 array."""
        values = values.detach().cpu()
        if self.mode in ("fp16", "bf16"):
            wire = torch.empty(values.numel(), dtype=torch.float16 if self.mode == "fp16" else torch.bfloat16)
            convert(values, wire)
            return wire.view(torch.uint8).numpy()
        flat = values.numpy() if values.dtype == torch.float32 else values.to(torch.float32).numpy()
        out = np.empty(self.wire_nbytes(flat.size), dtype=np.uint8)
        for values, records, rows in self._runs(flat.size):
            _encode_blocks(flat[values].reshape(rows, -1), out[records].reshape(rows, -1), self.levels)
        return out

    def decode(
        self,
        records: np.ndarray | memoryview,
        numel: int,
        out: torch.Tensor | None = None,
        scratch: np.ndarray | None = None,
    ) -> torch.Tensor:
        """The ``numel`` float32 values of whole ``records`` (uint8, starting at a record boundary).

        Args:
            records: The bytes.
            numel: How many values they hold.
            out: A flat float32 tensor of at least ``numel`` values to decode into (reused
                across chunks by a receiver, so that chunks do not fragment its heap).
            scratch: A uint8 array of at least ``len(records)`` bytes, reused the same way.

        Raises:
            SerializationError: The bytes are not whole records of ``numel`` values.
        """
        nbytes = memoryview(records).nbytes
        if nbytes != self.wire_nbytes(numel):
            raise SerializationError(f"{nbytes} bytes are not the {self.mode} records of {numel} values")
        # A writable copy, aligned for the views below (received frames are neither).
        data = (np.empty(nbytes, dtype=np.uint8) if scratch is None else scratch)[:nbytes]
        if nbytes:
            copy_bytes(data, records)
        out = (torch.empty(numel, dtype=torch.float32) if out is None else out)[:numel]
        if self.mode in ("fp16", "bf16"):
            convert(torch.from_numpy(data).view(torch.float16 if self.mode == "fp16" else torch.bfloat16), out)
            return out
        flat = out.numpy()
        for values, records, rows in self._runs(numel):
            _decode_blocks(data[records].reshape(rows, -1), flat[values].reshape(rows, -1), self.levels)
        return out

    def _runs(self, numel: int) -> Iterator[tuple[slice, slice, int]]:
        """``(values, records, rows)`` of each run of blocks that one numpy call takes: runs of
        `_BLOCK_ROWS` full blocks, then the last, shorter block on its own."""
        block, size = self.values_per_record, self.record_bytes
        full = numel // block
        for row in range(0, full, _BLOCK_ROWS):
            rows = min(_BLOCK_ROWS, full - row)
            yield slice(row * block, (row + rows) * block), slice(row * size, (row + rows) * size), rows
        if numel % block:
            yield slice(full * block, numel), slice(full * size, None), 1


#: Elements torch converts per call: below its grain size (32,768), so on the calling thread.
#: On a loaded 2-core VM, handing a conversion to torch's intra-op threads cost about 8 ms per
#: 8 MiB chunk against 0.3 ms done here.
_SLICE_ELEMENTS = 32_000
#: Blockwise records encoded or decoded per numpy call (1-2 MiB of float32 temporaries).
_BLOCK_ROWS = 64


def convert(source: torch.Tensor, target: torch.Tensor) -> None:
    """Copy ``source`` into ``target`` (flat, same length, another dtype) on this thread, a slice at a time."""
    for start in range(0, source.numel(), _SLICE_ELEMENTS):
        target[start : start + _SLICE_ELEMENTS].copy_(source[start : start + _SLICE_ELEMENTS])


def _encode_blocks(blocks: np.ndarray, records: np.ndarray, levels: int) -> None:
    """Records of ``blocks`` (rows of float32 values) into ``records``: a scale, then the values.

    ``levels`` 127: a signed byte per value; 7: a nibble per value (``q + 8``, the first of two
    in the low half of their byte).
    """
    scales = np.abs(blocks).max(axis=1) / np.float32(levels)
    # A block of zeros has scale 0: its values divide to 0 rather than NaN. A block with a NaN or
    # an infinity gets a NaN or infinite scale, so it decodes to non-finite values and is refused.
    with np.errstate(over="ignore"):
        inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales > 0)
    with np.errstate(invalid="ignore"):  # NaN values of such a block: their bytes do not matter
        quantized = np.rint(blocks * inverse[:, None])
        tiny = np.isinf(inverse)  # a scale below 1 / float32's largest: divided, as 0 * inf is NaN
        if tiny.any():
            quantized[tiny] = np.rint(blocks[tiny] / scales[tiny, None])
        np.clip(quantized, -levels, levels, out=quantized)
        codes = quantized.astype(np.int8)
    records[:, :4] = scales.astype("<f4").view(np.uint8).reshape(-1, 4)
    if levels == 127:
        records[:, 4:] = codes.view(np.uint8)
        return
    nibbles = (codes + 8).astype(np.uint8)
    if nibbles.shape[1] % 2:
        nibbles = np.pad(nibbles, ((0, 0), (0, 1)), constant_values=8)
    records[:, 4:] = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def _decode_blocks(records: np.ndarray, out: np.ndarray, levels: int) -> None:
    """Values of ``records`` (rows of a scale and the values) into ``out`` (rows of float32)."""
    scales = np.ascontiguousarray(records[:, :4]).view("<f4")
    if levels == 127:
        codes = records[:, 4:].view(np.int8)
    else:
        packed = records[:, 4:]
        codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int8)
        codes[:, 0::2] = (packed & 0x0F).astype(np.int8) - 8
        codes[:, 1::2] = (packed >> 4).astype(np.int8) - 8
        codes = codes[:, : out.shape[1]]
    with np.errstate(invalid="ignore"):  # 0 x an infinite scale: NaN, as it should be
        np.multiply(codes, scales, out=out, dtype=np.float32)


CODECS = {
    "fp16": WireCodec("fp16", "F16", 1, 2, 2.0**-11, 16),
    "bf16": WireCodec("bf16", "BF16", 1, 2, 2.0**-8, 16),
    "int8": WireCodec("int8", "U8", INT8_BLOCK, 4 + INT8_BLOCK, 0.5 / 127, 8, 127),
    "int4": WireCodec("int4", "U8", INT4_BLOCK, 4 + INT4_BLOCK // 2, 0.5 / 7, 4, 7),
}
#: The modes a tensor can be quantized in.
MODES = tuple(CODECS)


def codec_of(mode: object) -> WireCodec:
    """The codec of ``mode``; a `SerializationError` naming the modes for anything else."""
    codec = CODECS.get(mode) if isinstance(mode, str) else None
    if codec is None:
        raise SerializationError(f"unknown quantization mode {mode!r}: expected one of {', '.join(MODES)}")
    return codec


class QuantizedTensor:
    """A float tensor that is to travel quantized: referenced, never copied whole.

    Put one where a tensor would go in a message (`engine.model.quantize.quantized_copy` does
    it for a model's params); the receiver gets a float tensor of the same dtype and shape back.
    Only tensors that stream are quantized: with a chunk size of 0 the tensor travels inline,
    exactly.

    Args:
        tensor: The values (a float tensor, any device); it must not change while it is sent.
        mode: One of `MODES`.
        as_numpy: The receiver gets a numpy array (the value was one) rather than a tensor.

    Raises:
        SerializationError: The mode is unknown, or the tensor is not floating point.
    """

    def __init__(self, tensor: torch.Tensor, mode: str, as_numpy: bool = False) -> None:
        self.codec = codec_of(mode)
        if not tensor.is_floating_point() or tensor.dtype not in LOGICAL_DTYPES.values():
            raise SerializationError(f"only float tensors can be quantized, not {tensor.dtype}")
        self.tensor = tensor
        self.as_numpy = as_numpy
        self._contiguous: torch.Tensor | None = None

    def _flat(self) -> torch.Tensor:
        """The values, flat; a non-contiguous tensor is copied once (that tensor only) and kept while sent."""
        if self.tensor.is_contiguous():
            return self.tensor.detach().view(-1)
        if self._contiguous is None:
            self._contiguous = self.tensor.detach().contiguous().view(-1)
        return self._contiguous

    @property
    def mode(self) -> str:
        """The quantization mode."""
        return self.codec.mode

    @property
    def wire_nbytes(self) -> int:
        """Bytes the tensor takes on the wire."""
        return self.codec.wire_nbytes(self.tensor.numel())

    def wire_range(self, begin: int, end: int) -> memoryview:
        """Bytes ``[begin, end)`` of the wire entry, made now from the records that cover them."""
        codec, numel = self.codec, self.tensor.numel()
        first, last = begin // codec.record_bytes, (max(end, begin + 1) - 1) // codec.record_bytes
        start_value = first * codec.values_per_record
        stop_value = min((last + 1) * codec.values_per_record, numel)
        records = codec.encode(self._flat()[start_value:stop_value])
        offset = first * codec.record_bytes
        return memoryview(records)[begin - offset : end - offset]

    def meta(self) -> torch.Tensor:
        """A meta tensor of the wire entry (its dtype and shape), for laying out a stream."""
        codec = self.codec
        if codec.levels:  # blockwise: a flat run of records
            return torch.empty((self.wire_nbytes,), dtype=torch.uint8, device="meta")
        dtype = torch.float16 if codec.mode == "fp16" else torch.bfloat16
        return torch.empty(self.tensor.shape, dtype=dtype, device="meta")
