"""Datums: large buffers that travel as their own message frames, outside the msgpack body."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

Buffer = bytes | bytearray | memoryview

#: Byte strings at least this long are moved out of the msgpack body into their own frame.
DATUM_THRESHOLD_BYTES = 64 * 1024


class DatumType(IntEnum):
    """Datum object type (DOT): what a datum's frame holds, so a handler can claim it."""

    BYTES = 0  # plain bytes of the message
    TENSOR_BYTES = 1  # raw memory of one torch tensor (native serialization)
    ARRAY_BYTES = 2  # raw memory of one numpy array (native serialization)
    TENSOR_REF = 16  # reference to tensors served by the download service
    ARRAY_REF = 17  # reference to arrays served by the download service
    FILE_REF = 18  # reference to a file served by the download service


@dataclass(frozen=True)
class Datum:
    """A buffer to send as its own frame, zero-copy.

    Attributes:
        data: Any object with the buffer protocol; it must stay unchanged until the message is sent.
        dot: What the buffer holds.
    """

    data: Buffer
    dot: int = DatumType.BYTES

    @property
    def size(self) -> int:
        """Length of the buffer in bytes."""
        return memoryview(self.data).nbytes
