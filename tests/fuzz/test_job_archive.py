"""Fuzzing the job archive unpacker: the zip a server receives from an admin, a site from the server.

`unpack_job` must extract the archive or raise `JobArchiveError`, nothing else; a refusal
leaves nothing behind, and what it extracts are regular files and folders inside ``dest``
within the byte limit. The inputs are archives that `pack_job` wrote, or that a hostile peer
built with its own member headers (names, types, sizes, methods), then broken byte by byte.
"""

from __future__ import annotations

import io
import stat
import tempfile
import warnings
import zipfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.deploy.archive import JobArchiveError, pack_job, unpack_job
from engine.deploy.zip_directory import check_directory
from tests.zip_directories import empty_members

from .strategies import EDGE_INTS, FUZZ, mutated

MAX_BYTES = 1 << 16
MAX_MEMBERS = 16
PART = st.sampled_from(["app", "config", "custom", "a.conf", "train.py", "..", ".", "", "A", "a", "é", "x\\y", "c:"])
NAMES = st.lists(PART, min_size=1, max_size=3).map("/".join) | st.text(max_size=12)
CONTENT = st.binary(max_size=64) | st.sampled_from([b"\x00" * 5000, b"name = fedavg\n" * 50])


@st.composite
def packed(draw: st.DrawFn) -> bytes:
    """The archive `pack_job` writes for a small folder."""
    files = draw(st.dictionaries(st.sampled_from(["meta.conf", "app/config/a.conf", "app/custom/t.py"]), CONTENT))
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        root = Path(folder) / "job"
        root.mkdir()
        for relative, content in files.items():
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_bytes(content)
        return pack_job(root, Path(folder) / "job.zip").read_bytes()


@st.composite
def hand_made(draw: st.DrawFn) -> bytes:
    """An archive whose members' names, type bits, methods and flags the sender chose."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for _ in range(draw(st.integers(1, 4))):
            name = draw(NAMES.filter(bool))
            member = zipfile.ZipInfo(name)
            member.create_system = draw(st.sampled_from([0, 3]))
            kind = draw(st.sampled_from([0, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO]))
            member.external_attr = ((kind | 0o644) << 16) | draw(st.sampled_from([0, 0x10]))
            member.compress_type = draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))
            with warnings.catch_warnings():  # a duplicate name is a case to fuzz, not a warning to show
                warnings.simplefilter("ignore", UserWarning)
                zf.writestr(member, draw(CONTENT))
    return buffer.getvalue()


@st.composite
def lying_headers(draw: st.DrawFn) -> bytes:
    """A packed archive whose central directory declares other sizes, methods, flags or types."""
    data = bytearray(draw(packed()))
    start = data.rfind(b"PK\x01\x02")
    if start < 0:
        return bytes(data)
    field, width = draw(st.sampled_from([(8, 2), (10, 2), (20, 4), (24, 4), (38, 4), (42, 4), (28, 2)]))
    value = draw(EDGE_INTS.filter(lambda n: 0 <= n < 2 ** (8 * width)))  # flags, method, sizes, attrs, offset
    data[start + field : start + field + width] = value.to_bytes(width, "little")
    return bytes(data)


def deflate_bomb() -> bytes:
    """One member of 4 MiB of zeros, about 4 KiB compressed."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("meta.conf", b"\x00" * (4 << 20))
    return buffer.getvalue()


def corrupt_deflate() -> bytes:
    """A valid archive whose one deflated member's compressed bytes are not a deflate stream."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("meta.conf", b"name = fedavg\n" * 20)
    data = bytearray(buffer.getvalue())
    data[30 + len("meta.conf")] = 0xFF  # the first byte of the deflate stream: an invalid block type
    return bytes(data)


def with_central_field(offset: int, value: int) -> bytes:
    """A one-member archive whose central directory entry has the 2-byte field at ``offset`` set to ``value``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("meta.conf", b"name = fedavg\n")
    data = bytearray(buffer.getvalue())
    start = data.rfind(b"PK\x01\x02")
    data[start + offset : start + offset + 2] = value.to_bytes(2, "little")
    return bytes(data)


@st.composite
def end_records(draw: st.DrawFn) -> bytes:
    """Members written by hand with plain or ZIP64 end records, maybe a comment, maybe lying counts."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        count = draw(st.integers(0, 6))
        archive = empty_members(
            Path(folder) / "job.zip",
            count,
            declared=draw(st.none() | st.integers(0, 8) | st.just(600_000)),
            comment=draw(st.sampled_from([b"", b"a comment", b"PK\x05\x06", b"x" * 300])),
            zip64=draw(st.none() | st.booleans()),
        )
        return archive.read_bytes()


@st.composite
def lying_end_records(draw: st.DrawFn) -> bytes:
    """An archive whose end-of-central-directory record declares other counts, sizes, offsets or comment length."""
    data = bytearray(draw(packed() | end_records()))
    start = data.rfind(b"PK\x05\x06")
    if start < 0:
        return bytes(data)
    field, width = draw(st.sampled_from([(4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 2)]))
    value = draw(EDGE_INTS.filter(lambda n: 0 <= n < 2 ** (8 * width)))
    data[start + field : start + field + width] = value.to_bytes(width, "little")
    return bytes(data)


ARCHIVES = (
    mutated(packed())
    | mutated(hand_made())
    | lying_headers()
    | mutated(end_records())
    | lying_end_records()
    | st.binary(max_size=64)
)


@FUZZ
@given(content=ARCHIVES)
def test_the_directory_check_agrees_with_zipfile_or_refuses(content: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        archive = Path(folder) / "job.zip"
        archive.write_bytes(content)

        try:
            members = check_directory(archive, max_members=MAX_MEMBERS, max_directory_bytes=MAX_MEMBERS * 1024)
        except JobArchiveError as e:
            assert str(e)
            return

        assert 0 <= members <= MAX_MEMBERS
        try:
            listed = zipfile.ZipFile(archive).infolist()
        except (zipfile.BadZipFile, ValueError, NotImplementedError, UnicodeDecodeError, OSError):
            return  # unpack_job refuses what zipfile cannot read
        assert len(listed) == members, "zipfile built another member list than the one counted"


@FUZZ
@given(content=ARCHIVES)
@example(content=deflate_bomb())
@example(content=corrupt_deflate())  # crash found by this property: zlib.error escaped unpack_job
@example(content=with_central_field(6, 127))  # crash found: NotImplementedError "zip file version 12.7"
@example(content=with_central_field(8, 0x40))  # crash found: NotImplementedError "strong encryption"
def test_unpack_extracts_inside_dest_or_raises_and_leaves_nothing(content: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        archive, dest = Path(folder) / "job.zip", Path(folder) / "out"
        archive.write_bytes(content)

        try:
            unpack_job(archive, dest, max_bytes=MAX_BYTES)
        except JobArchiveError as e:
            assert str(e)
            assert not dest.exists(), "a refused archive left files behind"
            return

        extracted = list(dest.rglob("*"))
        assert all(not p.is_symlink() and (p.is_file() or p.is_dir()) for p in extracted)
        assert all(p.resolve().is_relative_to(dest.resolve()) for p in extracted)
        assert sum(p.stat().st_size for p in extracted if p.is_file()) <= MAX_BYTES


def test_a_member_that_is_not_deflate_data_is_refused_as_corrupt(tmp_path: Path) -> None:
    archive = tmp_path / "job.zip"
    archive.write_bytes(corrupt_deflate())

    with pytest.raises(JobArchiveError, match=r"member 'meta.conf': corrupt: Error -3 while decompressing data"):
        unpack_job(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        pytest.param(
            with_central_field(6, 127), r"not a zip archive this reader supports: zip file version 12.7", id="version"
        ),
        pytest.param(
            with_central_field(8, 0x40),
            r"member 'meta.conf': uses a zip feature .*strong encryption",
            id="strong-encryption",
        ),
        pytest.param(
            with_central_field(8, 0x20), r"member 'meta.conf': uses a zip feature .*patched data", id="patched-data"
        ),
    ],
)
def test_a_zip_feature_zipfile_cannot_read_is_refused(tmp_path: Path, content: bytes, match: str) -> None:
    archive = tmp_path / "job.zip"
    archive.write_bytes(content)

    with pytest.raises(JobArchiveError, match=match):
        unpack_job(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()
