"""Zip archives built byte by byte around their central directory, for the tests of archive limits.

`zipfile` would take minutes (and its own memory) to write 600,000 members; these functions write
the same bytes a hostile peer would in about a second: empty stored members, a central directory
entry for each, and the end records (ZIP64 when the counts need it), with counts that may lie.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

_LOCAL = struct.Struct("<4s5H3L2H")  # local file header, 30 bytes
_ENTRY = struct.Struct("<4s4B4HL2L5H2L")  # central directory entry, 46 bytes
_EOCD = struct.Struct("<4s4H2LH")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR = struct.Struct("<4sLQL")
_FILE_ATTR = 0o100644 << 16
_EMPTY_CRC = zlib.crc32(b"")


def empty_members(
    path: Path,
    count: int,
    *,
    declared: int | None = None,
    comment: bytes = b"",
    zip64: bool | None = None,
    disks: int = 1,
) -> Path:
    """Write an archive of ``count`` empty files named ``m000000``...; its end records declare ``declared``.

    Args:
        path: Where to write it.
        count: Members written, each with a local header and a central directory entry.
        declared: The entry count the end records give (default ``count``): a smaller one lies.
        comment: The archive comment after the end record.
        zip64: Write the ZIP64 end records; default: when a count does not fit in 16 bits.
        disks: The disk count the ZIP64 locator gives (more than 1: a multi-disk archive).

    Returns:
        ``path``.
    """
    declared = count if declared is None else declared
    zip64 = declared > 0xFFFF or count > 0xFFFF if zip64 is None else zip64
    names = [f"m{i:06d}".encode() for i in range(count)]
    local_size = _LOCAL.size + len(names[0]) if names else 0
    local = b"".join(_LOCAL.pack(b"PK\x03\x04", 20, 0, 0, 0, 0x21, _EMPTY_CRC, 0, 0, len(n), 0) + n for n in names)
    directory = b"".join(
        _ENTRY.pack(
            b"PK\x01\x02", 20, 3, 20, 0, 0, 0, 0, 0x21, _EMPTY_CRC, 0, 0, len(n), 0, 0, 0, 0, _FILE_ATTR, i * local_size
        )
        + n
        for i, n in enumerate(names)
    )
    offset = len(local)
    ends = b""
    if zip64:
        ends += _EOCD64.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, declared, declared, len(directory), offset)
        ends += _LOCATOR.pack(b"PK\x06\x07", 0, offset + len(directory), disks)
    small = min(declared, 0xFFFF)
    ends += _EOCD.pack(b"PK\x05\x06", 0, 0, small, small, len(directory), min(offset, 0xFFFFFFFF), len(comment))
    path.write_bytes(local + directory + ends + comment)
    return path
