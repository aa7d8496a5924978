"""Job folders as zip archives: packed deterministically, unpacked as if the archive were hostile.

A job travels from the admin to the server and from the server to every site as one zip file
(stdlib `zipfile`, deflate). `pack_job` writes the same bytes for the same folder, so
`archive_digest` identifies a job's content. `unpack_job` trusts nothing in the archive: names,
types, counts and sizes are checked before anything is written, bytes are counted while they are
written, and any refusal leaves ``dest`` empty. Public API::

    from engine.deploy.archive import JobArchiveError, archive_digest, pack_job, unpack_job
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.deploy.zip_directory import DIRECTORY_BYTES_PER_MEMBER, check_directory
from engine.errors import JobArchiveError

#: Most members (files and folders) a job archive may hold.
MAX_FILES = 10_000
#: Most bytes a job's files may hold together, uncompressed (1 GiB).
MAX_BYTES = 1 << 30
#: Highest uncompressed : compressed ratio of one member that is larger than `RATIO_CHECK_MIN_BYTES`.
MAX_RATIO = 200
#: Members smaller than this (1 MiB) are not ratio-checked: small files of zeros compress well.
RATIO_CHECK_MIN_BYTES = 1 << 20

_SKIPPED_FOLDERS = frozenset({"__pycache__"})
_SKIPPED_SUFFIXES = (".pyc",)
_FIXED_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_FILE_ATTR = (stat.S_IFREG | 0o644) << 16
_FOLDER_ATTR = ((stat.S_IFDIR | 0o755) << 16) | 0x10  # 0x10: the MS-DOS folder bit
_UNIX = 3
_COMPRESS_LEVEL = 6
_CHUNK_BYTES = 1 << 20
_DIRECTORY_ENTRY_BYTES = 46 + 28  # a central directory header, and room for a ZIP64 extra field
_ALLOWED_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_DRIVE = re.compile(r"^[A-Za-z]:")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class _Entry:
    """One member to pack: its archive name and, for files, the path to read."""

    name: str
    path: Path
    is_dir: bool
    size: int


def archive_digest(path: Path) -> str:
    """The SHA-256 (hex) of a file, read in chunks of 1 MiB.

    Args:
        path: The archive (or any file).
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def pack_job(folder: Path, dest: Path, *, max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES) -> Path:
    """Write a job folder as a zip archive; the same folder gives the same bytes.

    Members are the folder's files and folders, named relative to it with ``/`` separators,
    sorted, with fixed timestamps and modes. ``__pycache__`` folders and ``*.pyc`` files are
    left out.

    Args:
        folder: The job folder.
        dest: The archive to write; must not exist yet.
        max_files: Most members (files and folders) allowed, default `MAX_FILES`.
        max_bytes: Most bytes the files may hold together, default `MAX_BYTES` (1 GiB).

    Returns:
        ``dest``.

    Raises:
        JobArchiveError: ``dest`` exists; the folder holds a symlink or a special file (named),
            a name that `unpack_job` would refuse, or is over a limit.
    """
    folder, dest = Path(folder), Path(dest)
    if not folder.is_dir():
        raise JobArchiveError(f"{folder}: not a folder (a job is packed from its folder)")
    entries = list(_scan(folder, folder))
    entries.sort(key=lambda e: e.name)
    _check_folder_limits(folder, entries, max_files, max_bytes)
    names = _NameSet(str(folder))
    for entry in entries:
        names.add(entry.name, entry.is_dir, source=str(entry.path))
    try:
        out = open(dest, "xb")
    except FileExistsError as e:
        raise JobArchiveError(f"{dest}: already exists (pack_job never overwrites; remove it first)") from e
    try:
        with out, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=_COMPRESS_LEVEL) as zf:
            for entry in entries:
                _write_entry(zf, entry)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest


def _scan(folder: Path, top: Path) -> Iterator[_Entry]:
    """Yield the members under ``folder``; refuse symlinks and special files, naming them."""
    with os.scandir(folder) as it:
        children = sorted(it, key=lambda e: e.name)
    for child in children:
        path = Path(child.path)
        name = path.relative_to(top).as_posix()
        if child.is_symlink():
            raise JobArchiveError(f"{path}: is a symbolic link; a job folder may not hold links (copy the file in)")
        if child.is_dir(follow_symlinks=False):
            if child.name in _SKIPPED_FOLDERS:
                continue
            yield _Entry(name + "/", path, True, 0)
            yield from _scan(path, top)
        elif child.is_file(follow_symlinks=False):
            if not child.name.endswith(_SKIPPED_SUFFIXES):
                yield _Entry(name, path, False, child.stat(follow_symlinks=False).st_size)
        else:
            raise JobArchiveError(f"{path}: is not a regular file or a folder (a socket, pipe or device)")


def _check_folder_limits(folder: Path, entries: list[_Entry], max_files: int, max_bytes: int) -> None:
    if len(entries) > max_files:
        raise JobArchiveError(f"{folder}: holds {len(entries)} files and folders, over the limit of {max_files}")
    total = sum(e.size for e in entries)
    if total > max_bytes:
        raise JobArchiveError(f"{folder}: holds {total} bytes, over the limit of {max_bytes}")
    directory = sum(_DIRECTORY_ENTRY_BYTES + len(e.name.encode("utf-8", "surrogateescape")) for e in entries)
    if directory > max_files * DIRECTORY_BYTES_PER_MEMBER:
        raise JobArchiveError(
            f"{folder}: its names take {directory} bytes in an archive's directory, over the limit of "
            f"{max_files * DIRECTORY_BYTES_PER_MEMBER} (shorten the paths)"
        )


def _write_entry(zf: zipfile.ZipFile, entry: _Entry) -> None:
    info = zipfile.ZipInfo(entry.name, date_time=_FIXED_DATE_TIME)
    info.create_system = _UNIX
    if entry.is_dir:
        info.external_attr = _FOLDER_ATTR
        zf.writestr(info, b"")
        return
    info.external_attr = _FILE_ATTR
    info.compress_type = zipfile.ZIP_DEFLATED
    info.file_size = entry.size  # lets zipfile choose zip64 headers up front for large files
    fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise JobArchiveError(f"{entry.path}: is not a regular file")
        with zf.open(info, "w") as out:
            shutil.copyfileobj(src, out, _CHUNK_BYTES)


class _NameSet:
    """Member names seen so far; refuses unsafe names, duplicates and file/folder clashes."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._seen: dict[str, str] = {}  # case-folded path -> the member that claimed it
        self._files: set[str] = set()  # case-folded paths of files
        self._parents: set[str] = set()  # case-folded paths of every folder a member lies in

    def add(self, name: str, is_dir: bool, source: str | None = None) -> None:
        label = source or f"{self._where}: member {name!r}"
        parts = _check_name(name, label)
        key = "/".join(parts).casefold()
        if key in self._seen:
            first = self._seen[key]
            note = "" if first == name else " (names are compared ignoring case)"
            raise JobArchiveError(f"{label}: duplicate of member {first!r}{note}")
        if not is_dir and key in self._parents:
            raise JobArchiveError(f"{label}: is a file, but other members lie under it")
        parents = ["/".join(parts[:i]).casefold() for i in range(1, len(parts))]
        for parent in parents:
            if parent in self._files:
                raise JobArchiveError(f"{label}: lies under {parent!r}, which is a file")
        self._seen[key] = name
        self._parents.update(parents)
        if not is_dir:
            self._files.add(key)


def _check_name(name: str, label: str) -> list[str]:
    """The parts of a member name; refuse any name that could land outside the job folder."""
    if not name or name == "/":
        raise JobArchiveError(f"{label}: empty name")
    if _CONTROL.search(name):
        raise JobArchiveError(f"{label}: NUL or control character in the name")
    if "\\" in name:
        raise JobArchiveError(f"{label}: backslash in the name (a Windows separator; names use '/')")
    if name.startswith("/"):
        raise JobArchiveError(f"{label}: absolute name")
    if _DRIVE.match(name):
        raise JobArchiveError(f"{label}: drive letter in the name")
    parts = name.removesuffix("/").split("/")
    if ".." in parts:
        raise JobArchiveError(f"{label}: a '..' part would leave the job folder")
    if any(part in ("", ".") for part in parts):
        raise JobArchiveError(f"{label}: empty or '.' part in the name")
    return parts


def unpack_job(archive: Path, dest: Path, *, max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES) -> Path:
    """Extract a job archive into ``dest``, refusing anything unsafe; a refusal leaves nothing.

    The archive's end records are read first, with constant memory (`check_directory`): a
    member count over ``max_files`` or a central directory over ``DIRECTORY_BYTES_PER_MEMBER``
    bytes a member is refused before `zipfile` builds its member list. Then every member is
    checked before the first byte is written: names (absolute, ``..``,
    backslash, NUL or control characters, drive letters, duplicates also ignoring case), types
    (symlinks and other non-regular members), encryption and compression method, the member
    count and the declared sizes, and a compression ratio over `MAX_RATIO` on members over
    `RATIO_CHECK_MIN_BYTES`. While extracting, the bytes really written are counted against
    ``max_bytes`` (declared sizes can lie). Files are written 0600 with ``O_EXCL|O_NOFOLLOW``
    through folder descriptors, folders 0700; no symlink is ever followed.

    Args:
        archive: The zip file.
        dest: Folder to extract into: must not exist (it is created 0700; its parent must
            exist) or be an empty folder.
        max_files: Most members (files and folders), default `MAX_FILES`.
        max_bytes: Most bytes the files may hold together, default `MAX_BYTES` (1 GiB).

    Returns:
        ``dest``.

    Raises:
        JobArchiveError: Naming the member and the rule it breaks; ``dest`` is then removed (if
            this call created it) or emptied.
    """
    archive, dest = Path(archive), Path(dest)
    created = _prepare_dest(dest)
    try:
        check_directory(archive, max_members=max_files, max_directory_bytes=max_files * DIRECTORY_BYTES_PER_MEMBER)
        with _open_archive(archive) as zf:
            members = zf.infolist()
            _check_members(archive, members, max_files, max_bytes)
            _extract_all(archive, zf, members, dest, max_bytes)
    except BaseException:
        _clean(dest, remove=created)
        raise
    return dest


def _prepare_dest(dest: Path) -> bool:
    """Create ``dest`` 0700, or accept an existing empty real folder; True when created here."""
    if dest.is_symlink():
        raise JobArchiveError(f"{dest}: is a symbolic link (unpack into a real, empty folder)")
    if dest.exists():
        if not dest.is_dir() or any(dest.iterdir()):
            raise JobArchiveError(f"{dest}: exists and is not an empty folder")
        os.chmod(dest, 0o700)
        return False
    try:
        dest.mkdir(mode=0o700)
    except OSError as e:
        raise JobArchiveError(f"{dest}: cannot create the folder: {e.strerror}") from e
    os.chmod(dest, 0o700)  # mkdir's mode is masked by the umask
    return True


def _open_archive(archive: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError) as e:
        raise JobArchiveError(f"{archive}: not a readable zip archive: {e}") from e
    except NotImplementedError as e:  # a member needs a newer zip version than zipfile reads
        raise JobArchiveError(f"{archive}: not a zip archive this reader supports: {e}") from e
    except OSError as e:
        raise JobArchiveError(f"{archive}: cannot open: {e.strerror}") from e


def _check_members(archive: Path, members: list[zipfile.ZipInfo], max_files: int, max_bytes: int) -> None:
    if len(members) > max_files:
        raise JobArchiveError(
            f"{archive}: member {members[max_files].orig_filename!r}: "
            f"more than {max_files} members ({len(members)} in all)"
        )
    names = _NameSet(str(archive))
    declared = 0
    for info in members:
        label = f"{archive}: member {info.orig_filename!r}"
        is_dir = _member_is_dir(info, label)
        names.add(info.orig_filename, is_dir)
        if info.flag_bits & 0x1:
            raise JobArchiveError(f"{label}: encrypted members are not supported")
        if info.compress_type not in _ALLOWED_METHODS:
            raise JobArchiveError(f"{label}: compression method {info.compress_type} (only stored or deflate)")
        if is_dir:
            continue
        declared += info.file_size
        if declared > max_bytes:
            raise JobArchiveError(f"{label}: declared sizes add up to more than the limit of {max_bytes} bytes")
        if info.file_size > RATIO_CHECK_MIN_BYTES and info.file_size > MAX_RATIO * max(info.compress_size, 1):
            raise JobArchiveError(
                f"{label}: compression ratio over {MAX_RATIO}:1 "
                f"({info.file_size} bytes from {info.compress_size}; a zip bomb?)"
            )


def _member_is_dir(info: zipfile.ZipInfo, label: str) -> bool:
    """Whether a member is a folder; refuse symlinks, special files and mixed signals."""
    by_name = info.orig_filename.endswith("/")
    kind = stat.S_IFMT(info.external_attr >> 16)
    if kind == stat.S_IFLNK:
        raise JobArchiveError(f"{label}: is a symbolic link (job archives may not hold links)")
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise JobArchiveError(f"{label}: is not a regular file or a folder (file type {oct(kind)})")
    if kind and (kind == stat.S_IFDIR) != by_name:
        raise JobArchiveError(f"{label}: its type bits and its name disagree on whether it is a folder")
    if by_name and info.file_size:
        raise JobArchiveError(f"{label}: a folder member with content")
    return by_name


def _extract_all(archive: Path, zf: zipfile.ZipFile, members: list[zipfile.ZipInfo], dest: Path, limit: int) -> None:
    root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    written = 0
    try:
        for info in members:
            label = f"{archive}: member {info.orig_filename!r}"
            parts = info.orig_filename.removesuffix("/").split("/")
            try:
                if info.orig_filename.endswith("/"):
                    os.close(_open_folder(root_fd, parts))
                else:
                    written = _extract_file(zf, info, root_fd, parts, written, limit, label)
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as e:
                raise JobArchiveError(f"{label}: corrupt: {e}") from e
            except NotImplementedError as e:  # flag bits of patched data or strong encryption
                raise JobArchiveError(f"{label}: uses a zip feature this reader does not support: {e}") from e
            except OSError as e:
                raise JobArchiveError(f"{label}: cannot be written: {e.strerror or e}") from e
    finally:
        os.close(root_fd)


def _open_folder(root_fd: int, parts: list[str]) -> int:
    """Open (creating 0700 where missing) the folder ``parts`` under ``root_fd``, never following links."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
            if created:
                os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _extract_file(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, root_fd: int, parts: list[str], written: int, limit: int, label: str
) -> int:
    """Stream one member to a new 0600 file; return the running total of bytes written."""
    parent_fd = _open_folder(root_fd, parts[:-1])
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(parts[-1], flags, 0o600, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    with os.fdopen(fd, "wb") as out, zf.open(info) as src:
        os.fchmod(out.fileno(), 0o600)
        member_bytes = 0
        while chunk := src.read(_CHUNK_BYTES):
            member_bytes += len(chunk)
            written += len(chunk)
            if written > limit:
                raise JobArchiveError(f"{label}: extracting passes the limit of {limit} bytes (a zip bomb?)")
            if member_bytes > info.file_size:
                raise JobArchiveError(f"{label}: holds more than its declared {info.file_size} bytes (a zip bomb?)")
            out.write(chunk)
    return written


def _clean(dest: Path, *, remove: bool) -> None:
    """Remove what was extracted: ``dest`` itself when this call created it, else its contents."""
    if remove:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for child in dest.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
