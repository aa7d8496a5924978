"""The central directory of a zip archive, counted from its end records before `zipfile` reads it.

`zipfile.ZipFile` builds a `zipfile.ZipInfo` (about 570 bytes) for every entry of the central
directory as soon as it opens an archive, and it walks the directory by its size in bytes, not by
the entry count the end record declares. A hostile archive of 65 MB holding 600,000 empty members
costs its reader over 300 MiB before any per-member check can run. `check_directory` reads what
`zipfile` would read, in the same places (the end-of-central-directory record, the ZIP64 locator
and record when present, an archive comment after the end record), and refuses an archive whose
declared entry count or directory size is over a limit, or whose directory really holds more
entries than allowed or than it declares, with constant memory. Public API::

    from engine.deploy.zip_directory import check_directory

    members = check_directory(Path("job.zip"), max_members=10_000, max_directory_bytes=10 << 20)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine.errors import JobArchiveError

#: Bytes of the central directory allowed per member: a 46-byte header, a name and its extra fields.
DIRECTORY_BYTES_PER_MEMBER = 1024

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record, 22 bytes
_EOCD_SIGNATURE = b"PK\x05\x06"
_MAX_COMMENT_BYTES = (1 << 16) - 1
_LOCATOR = struct.Struct("<4sLQL")  # ZIP64 end of central directory locator, 20 bytes
_LOCATOR_SIGNATURE = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # ZIP64 end of central directory record, 56 bytes
_EOCD64_SIGNATURE = b"PK\x06\x06"
_ENTRY = struct.Struct("<4s4B4HL2L5H2L")  # central directory entry header, 46 bytes
_ENTRY_SIGNATURE = b"PK\x01\x02"


@dataclass(frozen=True)
class DirectoryExtent:
    """Where an archive's central directory lies and what its end records declare of it.

    Attributes:
        entries: The entry count declared (the larger of "on this disk" and "in all").
        size_bytes: The directory's size in bytes, as declared.
        start: The file offset `zipfile` reads it from: just before the end records, whatever
            offset they declare (an archive may have been appended to another file).
        zip64: Whether a ZIP64 end record gave these values.
    """

    entries: int
    size_bytes: int
    start: int
    zip64: bool


def read_extent(archive: Path, source: BinaryIO) -> DirectoryExtent:
    """Read the end records of ``source`` as `zipfile` does; nothing of the directory itself.

    Args:
        archive: The archive's path, for messages.
        source: The archive, open for reading in binary mode.

    Raises:
        JobArchiveError: No end record, a multi-disk archive, or a directory that would start
            before the file does.
    """
    file_size = source.seek(0, os.SEEK_END)
    where = _find_end_record(archive, source, file_size)
    source.seek(where)
    _, _, _, on_disk, total, size_bytes, _, _ = _EOCD.unpack(source.read(_EOCD.size))
    entries, zip64, end = max(on_disk, total), False, where
    zip64_values = _read_zip64(archive, source, where)
    if zip64_values is not None:
        entries, size_bytes = zip64_values
        zip64, end = True, where - _LOCATOR.size - _EOCD64.size
    start = end - size_bytes
    if start < 0:
        raise JobArchiveError(
            f"{archive}: its end record declares a central directory of {size_bytes} bytes, "
            f"more than the {end} bytes before it (a corrupt or hostile archive)"
        )
    return DirectoryExtent(entries, size_bytes, start, zip64)


def check_directory(archive: Path, *, max_members: int, max_directory_bytes: int) -> int:
    """Refuse an archive whose central directory is over a limit, before anything builds a member list.

    The declared entry count and directory size are checked first; then the directory is walked
    entry by entry, holding one 46-byte header at a time, as far as `zipfile` would walk it.

    Args:
        archive: The zip file.
        max_members: Most entries allowed.
        max_directory_bytes: Most bytes the central directory may take.

    Returns:
        The number of entries; the directory holds exactly as many as its end record declares.

    Raises:
        JobArchiveError: Naming the limit or the record that breaks it, e.g.
            ``job.zip: more than 10000 members (600000 declared by its end record)``.
    """
    try:
        with open(archive, "rb") as source:
            extent = read_extent(archive, source)
            if extent.entries > max_members:
                raise JobArchiveError(
                    f"{archive}: more than {max_members} members ({extent.entries} declared by its end record)"
                )
            if extent.size_bytes > max_directory_bytes:
                raise JobArchiveError(
                    f"{archive}: its central directory takes {extent.size_bytes} bytes, over the limit of "
                    f"{max_directory_bytes} ({DIRECTORY_BYTES_PER_MEMBER} bytes a member)"
                )
            walked = _walk(archive, source, extent, max_members)
    except OSError as e:
        raise JobArchiveError(f"{archive}: cannot open: {e.strerror or e}") from e
    if walked != extent.entries:
        raise JobArchiveError(
            f"{archive}: its central directory holds {walked} entries but its end record declares "
            f"{extent.entries} (a corrupt or hostile archive)"
        )
    return walked


def _find_end_record(archive: Path, source: BinaryIO, file_size: int) -> int:
    """The offset of the end-of-central-directory record: last in the file, or before a comment."""
    if file_size >= _EOCD.size:
        source.seek(file_size - _EOCD.size)
        tail = source.read(_EOCD.size)
        if tail.startswith(_EOCD_SIGNATURE) and tail.endswith(b"\x00\x00"):  # no comment
            return file_size - _EOCD.size
        # A comment of up to 64 KiB follows the record; like zipfile, take the last signature.
        window = max(file_size - _MAX_COMMENT_BYTES - _EOCD.size, 0)
        source.seek(window)
        found = source.read().rfind(_EOCD_SIGNATURE)
        if found >= 0 and window + found + _EOCD.size <= file_size:
            return window + found
    raise JobArchiveError(f"{archive}: not a readable zip archive (no end-of-central-directory record)")


def _read_zip64(archive: Path, source: BinaryIO, where: int) -> tuple[int, int] | None:
    """The entry count and directory size of the ZIP64 record before the end record, if there is one."""
    if where < _LOCATOR.size:
        return None
    source.seek(where - _LOCATOR.size)
    signature, disk, _, disks = _LOCATOR.unpack(source.read(_LOCATOR.size))
    if signature != _LOCATOR_SIGNATURE:
        return None
    if disk != 0 or disks > 1:
        raise JobArchiveError(f"{archive}: spans {disks} disks; multi-disk archives are not supported")
    record = where - _LOCATOR.size - _EOCD64.size
    if record < 0:
        return None
    source.seek(record)
    fields = _EOCD64.unpack(source.read(_EOCD64.size))
    if fields[0] != _EOCD64_SIGNATURE:  # zipfile then keeps the values of the 32-bit record
        return None
    on_disk, total, size_bytes = fields[6], fields[7], fields[8]
    return max(on_disk, total), size_bytes


def _walk(archive: Path, source: BinaryIO, extent: DirectoryExtent, max_members: int) -> int:
    """Count the entries `zipfile` would read from the directory, one header at a time; refuse past ``max_members``."""
    available = min(extent.size_bytes, source.seek(0, os.SEEK_END) - extent.start)
    offset = count = 0
    while offset < extent.size_bytes:
        if offset + _ENTRY.size > available:
            raise JobArchiveError(f"{archive}: truncated central directory (entry {count + 1} is cut short)")
        source.seek(extent.start + offset)
        fields = _ENTRY.unpack(source.read(_ENTRY.size))
        if fields[0] != _ENTRY_SIGNATURE:
            raise JobArchiveError(f"{archive}: central directory entry {count + 1} has no entry signature")
        count += 1
        if count > max_members:
            raise JobArchiveError(
                f"{archive}: its central directory holds more than {max_members} members "
                f"(its end record declares {extent.entries})"
            )
        name_bytes, extra_bytes, comment_bytes = fields[12], fields[13], fields[14]
        offset += _ENTRY.size + name_bytes + extra_bytes + comment_bytes
    return count
