"""Job archives: packed the same way every time, unpacked as if hostile, refusals leave nothing."""

from __future__ import annotations

import io
import os
import shutil
import stat
import struct
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.deploy.archive import JobArchiveError, archive_digest, pack_job, unpack_job
from engine.deploy.zip_directory import check_directory
from tests.zip_directories import empty_members

FEDAVG = Path(__file__).resolve().parents[3] / "jobs" / "fedavg"


def packed_files(folder: Path) -> dict[str, bytes]:
    """Relative path -> content of every file pack_job takes from ``folder``."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def write_zip(path: Path, members: list[tuple[str | zipfile.ZipInfo, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def info(name: str, file_type: int) -> zipfile.ZipInfo:
    member = zipfile.ZipInfo(name)
    member.create_system = 3
    member.external_attr = (file_type | 0o644) << 16
    return member


# --- pack ----------------------------------------------------------------------------------------


def test_pack_then_unpack_gives_the_same_files(tmp_path: Path) -> None:
    archive = pack_job(FEDAVG, tmp_path / "fedavg.zip")

    out = unpack_job(archive, tmp_path / "out")

    assert packed_files(out) == packed_files(FEDAVG)
    assert zipfile.ZipFile(archive).namelist() == sorted(zipfile.ZipFile(archive).namelist())


def test_packing_twice_gives_the_same_bytes_whatever_the_file_times(tmp_path: Path) -> None:
    copy = shutil.copytree(FEDAVG, tmp_path / "fedavg")
    for path in copy.rglob("*"):
        os.utime(path, (1_000_000_000, 1_000_000_000))

    first = pack_job(FEDAVG, tmp_path / "a.zip")
    second = pack_job(copy, tmp_path / "b.zip")

    assert first.read_bytes() == second.read_bytes()
    assert archive_digest(first) == archive_digest(second)


def test_unpacked_files_are_private(tmp_path: Path) -> None:
    out = unpack_job(pack_job(FEDAVG, tmp_path / "fedavg.zip"), tmp_path / "out")

    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*")}

    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert modes["meta.conf"] == 0o600
    assert modes["app/custom"] == 0o700
    assert set(modes.values()) == {0o600, 0o700}


def test_pack_leaves_out_bytecode(tmp_path: Path) -> None:
    job = shutil.copytree(FEDAVG, tmp_path / "job")
    (job / "app" / "custom" / "__pycache__").mkdir(exist_ok=True)
    (job / "app" / "custom" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    (job / "app" / "custom" / "stale.pyc").write_bytes(b"\0")

    names = zipfile.ZipFile(pack_job(job, tmp_path / "job.zip")).namelist()

    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert "app/custom/train.py" in names


def link_to_a_file(job: Path) -> Path:
    link = job / "app" / "custom" / "link.py"
    link.symlink_to(job / "app" / "custom" / "train.py")
    return link


def link_to_a_folder(job: Path) -> Path:
    link = job / "app" / "etc"
    link.symlink_to("/etc")
    return link


def fifo(job: Path) -> Path:
    path = job / "app" / "pipe"
    os.mkfifo(path)
    return path


def backslash_name(job: Path) -> Path:
    path = job / "app" / "a\\b.py"
    path.write_text("x = 1\n", encoding="utf-8")
    return path


def names_equal_but_for_case(job: Path) -> Path:
    path = job / "app" / "custom" / "TRAIN.py"
    path.write_text("x = 1\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("make", "rule"),
    [
        (link_to_a_file, "is a symbolic link"),
        (link_to_a_folder, "is a symbolic link"),
        (fifo, "is not a regular file or a folder"),
        (backslash_name, "backslash in the name"),
        (names_equal_but_for_case, "duplicate of member"),
    ],
    ids=["symlink-to-file", "symlink-to-folder", "fifo", "backslash", "case-duplicate"],
)
def test_pack_refuses_what_could_not_travel_naming_the_path(
    tmp_path: Path, make: Callable[[Path], Path], rule: str
) -> None:
    job = shutil.copytree(FEDAVG, tmp_path / "job")
    path = make(job)

    with pytest.raises(JobArchiveError, match=rule) as caught:
        pack_job(job, tmp_path / "job.zip")

    assert path.relative_to(job).as_posix() in str(caught.value)
    assert not (tmp_path / "job.zip").exists()


@pytest.mark.parametrize(
    ("limits", "rule"),
    [({"max_files": 5}, "holds 7 files and folders, over the limit of 5"), ({"max_bytes": 1000}, "over the limit")],
    ids=["too-many-files", "too-many-bytes"],
)
def test_pack_refuses_a_folder_over_a_limit(tmp_path: Path, limits: dict[str, int], rule: str) -> None:
    with pytest.raises(JobArchiveError, match=rule):
        pack_job(FEDAVG, tmp_path / "job.zip", **limits)

    assert not (tmp_path / "job.zip").exists()


def test_pack_never_overwrites(tmp_path: Path) -> None:
    (tmp_path / "job.zip").write_bytes(b"mine")

    with pytest.raises(JobArchiveError, match="already exists"):
        pack_job(FEDAVG, tmp_path / "job.zip")

    assert (tmp_path / "job.zip").read_bytes() == b"mine"


# --- unpack: hostile archives ----------------------------------------------------------------------

GOOD = ("meta.conf", b"name = x\n")


def parent_escape(path: Path) -> Path:
    return write_zip(path, [GOOD, ("app/../../evil.py", b"boom")])


def absolute_name(path: Path) -> Path:
    return write_zip(path, [GOOD, ("/tmp/evil.py", b"boom")])


def backslash(path: Path) -> Path:
    return write_zip(path, [GOOD, ("..\\evil.py", b"boom")])


def drive_letter(path: Path) -> Path:
    return write_zip(path, [GOOD, ("C:/evil.py", b"boom")])


def nul_in_name(path: Path) -> Path:
    write_zip(path, [GOOD, ("evilXpy/../../x", b"boom")])
    # zipfile cuts names at a NUL when writing; put one in both headers by hand.
    path.write_bytes(path.read_bytes().replace(b"evilXpy", b"evil\0py"))
    return path


def symlink_member(path: Path) -> Path:
    return write_zip(path, [GOOD, (info("app/link", stat.S_IFLNK), b"/etc/passwd")])


def fifo_member(path: Path) -> Path:
    return write_zip(path, [GOOD, (info("app/pipe", stat.S_IFIFO), b"")])


def duplicate(path: Path) -> Path:
    with pytest.warns(UserWarning, match="Duplicate name"):
        return write_zip(path, [GOOD, ("app/a.py", b"1"), ("app/a.py", b"2")])


def duplicate_but_for_case(path: Path) -> Path:
    return write_zip(path, [GOOD, ("app/a.py", b"1"), ("app/A.py", b"2")])


def file_above_a_member(path: Path) -> Path:
    return write_zip(path, [GOOD, ("app", b"1"), ("app/a.py", b"2")])


def declared_too_big(path: Path) -> Path:
    return write_zip(path, [GOOD, ("app/big.bin", os.urandom(2000))])


def high_ratio(path: Path) -> Path:
    return write_zip(path, [GOOD, ("app/zeros.bin", bytes(2 << 20))])


def lying_sizes(path: Path) -> Path:
    """A member of 4 MiB whose headers (local and central) declare 100 bytes."""
    write_zip(path, [GOOD, ("app/bomb.bin", os.urandom(4 << 20))])
    with zipfile.ZipFile(path) as zf:
        member, central = zf.getinfo("app/bomb.bin"), zf.start_dir
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, member.header_offset + 22, 100)  # local header: uncompressed size
    for offset in _central_entries(bytes(data), central):
        if data[offset + 46 : offset + 46 + len(b"app/bomb.bin")] == b"app/bomb.bin":
            struct.pack_into("<I", data, offset + 24, 100)  # central entry: uncompressed size
    path.write_bytes(bytes(data))
    return path


def _central_entries(data: bytes, start: int) -> list[int]:
    offsets, offset = [], start
    while data[offset : offset + 4] == b"PK\x01\x02":
        offsets.append(offset)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, offset + 28)
        offset += 46 + name_len + extra_len + comment_len
    return offsets


HOSTILE = [
    (parent_escape, "app/../../evil.py", "'..' part", {}),
    (absolute_name, "/tmp/evil.py", "absolute name", {}),
    (backslash, "..\\evil.py", "backslash in the name", {}),
    (drive_letter, "C:/evil.py", "drive letter", {}),
    (nul_in_name, "evil\x00py/../../x", "NUL or control character", {}),
    (symlink_member, "app/link", "is a symbolic link", {}),
    (fifo_member, "app/pipe", "not a regular file or a folder", {}),
    (duplicate, "app/a.py", "duplicate of member", {}),
    (duplicate_but_for_case, "app/A.py", "duplicate of member 'app/a.py'", {}),
    (file_above_a_member, "app/a.py", "lies under 'app', which is a file", {}),
    (declared_too_big, "app/big.bin", "declared sizes add up to more than the limit of 1000", {"max_bytes": 1000}),
    (high_ratio, "app/zeros.bin", "compression ratio over 200:1", {}),
    (lying_sizes, "app/bomb.bin", "corrupt", {"max_bytes": 1000}),
]


@pytest.mark.parametrize("pre_existing", [False, True], ids=["dest-new", "dest-empty"])
@pytest.mark.parametrize(
    ("make", "member", "rule", "limits"), HOSTILE, ids=[h[0].__name__.replace("_", "-") for h in HOSTILE]
)
def test_a_hostile_archive_is_refused_naming_the_member_and_leaves_nothing(
    tmp_path: Path, make: Callable[[Path], Path], member: str, rule: str, limits: dict[str, int], pre_existing: bool
) -> None:
    archive = make(tmp_path / "job.zip")
    dest = tmp_path / "dest"
    if pre_existing:
        dest.mkdir()

    with pytest.raises(JobArchiveError, match=rule) as caught:
        unpack_job(archive, dest, **limits)

    assert f"member {member!r}" in str(caught.value)
    assert (not dest.exists()) if not pre_existing else list(dest.iterdir()) == []
    assert not (tmp_path / "evil.py").exists()


def serve_more_than_declared(monkeypatch: pytest.MonkeyPatch, member: str, size_bytes: int) -> None:
    """Make zipfile read ``member`` as ``size_bytes`` bytes, whatever its headers say.

    CPython's zipfile stops at the declared size itself; this stands for a reader that does not,
    to show unpack_job counts what it writes rather than trusting the headers.
    """
    real_open = zipfile.ZipFile.open

    def lying_open(self: zipfile.ZipFile, name: zipfile.ZipInfo, *args: object, **kwargs: object) -> object:
        if name.filename == member:
            return io.BytesIO(b"x" * size_bytes)
        return real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", lying_open)


def test_bytes_beyond_the_declared_size_are_never_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = write_zip(tmp_path / "job.zip", [GOOD, ("app/bomb.bin", b"x" * 10)])
    serve_more_than_declared(monkeypatch, "app/bomb.bin", 3 << 20)

    with pytest.raises(JobArchiveError, match="'app/bomb.bin': holds more than its declared 10 bytes"):
        unpack_job(archive, tmp_path / "dest")

    assert not (tmp_path / "dest").exists()


def test_extraction_stops_at_the_byte_limit_whatever_was_declared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = write_zip(tmp_path / "job.zip", [GOOD, ("app/bomb.bin", b"x" * 10)])
    serve_more_than_declared(monkeypatch, "app/bomb.bin", 5000)

    with pytest.raises(JobArchiveError, match="'app/bomb.bin': extracting passes the limit of 1000 bytes"):
        unpack_job(archive, tmp_path / "dest", max_bytes=1000)

    assert not (tmp_path / "dest").exists()


def test_a_file_that_is_not_a_zip_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "job.zip"
    archive.write_bytes(b"not a zip at all")

    with pytest.raises(JobArchiveError, match="not a readable zip archive"):
        unpack_job(archive, tmp_path / "dest")

    assert not (tmp_path / "dest").exists()


def test_unpack_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    archive = pack_job(FEDAVG, tmp_path / "fedavg.zip")
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "mine.txt").write_text("keep me", encoding="utf-8")

    with pytest.raises(JobArchiveError, match="exists and is not an empty folder"):
        unpack_job(archive, tmp_path / "dest")

    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["mine.txt"]


def test_unpack_refuses_a_dest_that_is_a_symlink(tmp_path: Path) -> None:
    archive = pack_job(FEDAVG, tmp_path / "fedavg.zip")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dest").symlink_to(tmp_path / "elsewhere")

    with pytest.raises(JobArchiveError, match="is a symbolic link"):
        unpack_job(archive, tmp_path / "dest")

    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_archive_digest_is_the_sha256_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")

    assert archive_digest(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


# ----------------------------------------------------------------- the central directory, before zipfile


def with_end_record_field(path: Path, offset: int, fmt: str, value: int) -> Path:
    """``path`` with the field at ``offset`` of its (32-bit) end-of-central-directory record set to ``value``."""
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, data.rfind(b"PK\x05\x06") + offset, value)
    path.write_bytes(bytes(data))
    return path


DIRECTORY_LIMITS = [
    pytest.param(
        lambda p: empty_members(p, 5),
        {"max_files": 3},
        r"more than 3 members \(5 declared by its end record\)",
        id="declared-count",
    ),
    pytest.param(
        lambda p: empty_members(p, 3, declared=600_000),
        {},
        r"more than 10000 members \(600000 declared",
        id="zip64-declared-count",
    ),
    pytest.param(
        lambda p: empty_members(p, 20, comment=b"made by hand" * 100),
        {"max_files": 10},
        r"more than 10 members \(20 declared",
        id="after-a-comment",
    ),
    pytest.param(
        lambda p: empty_members(p, 50, declared=2),
        {"max_files": 10},
        r"holds more than 10 members \(its end record declares 2\)",
        id="lying-count",
    ),
    pytest.param(
        lambda p: empty_members(p, 5, declared=3),
        {},
        r"holds 5 entries but its end record declares 3",
        id="count-mismatch",
    ),
    pytest.param(
        lambda p: empty_members(p, 30, declared=1),
        {"max_files": 1},
        r"central directory takes 1590 bytes, over the limit of 1024 \(1024 bytes a member\)",
        id="directory-size",
    ),
    pytest.param(
        lambda p: with_end_record_field(empty_members(p, 2), 12, "<L", 1 << 20),
        {},
        r"declares a central directory of 1048576 bytes, more than the \d+ bytes before it",
        id="directory-before-the-file",
    ),
    pytest.param(
        lambda p: with_end_record_field(empty_members(p, 2), 12, "<L", 7),
        {},
        r"truncated central directory",
        id="directory-cut-short",
    ),
    pytest.param(lambda p: empty_members(p, 2, zip64=True, disks=2), {}, r"spans 2 disks", id="multi-disk"),
]


@pytest.mark.parametrize(("make", "limits", "rule"), DIRECTORY_LIMITS)
def test_an_archive_over_a_directory_limit_is_refused_from_its_end_records(
    tmp_path: Path, make: Callable[[Path], Path], limits: dict[str, int], rule: str
) -> None:
    archive = make(tmp_path / "job.zip")

    with pytest.raises(JobArchiveError, match=rule):
        unpack_job(archive, tmp_path / "dest", **limits)

    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize(
    "options", [{}, {"comment": b"a comment after the end record"}, {"zip64": True}], ids=["plain", "comment", "zip64"]
)
def test_end_records_are_read_where_zipfile_reads_them(tmp_path: Path, options: dict[str, object]) -> None:
    archive = empty_members(tmp_path / "job.zip", 4, **options)

    assert check_directory(archive, max_members=4, max_directory_bytes=4 * 1024) == 4
    assert sorted(p.name for p in unpack_job(archive, tmp_path / "dest").iterdir()) == [f"m{i:06d}" for i in range(4)]


def test_600000_empty_members_are_refused_without_building_a_member_list(tmp_path: Path) -> None:
    archive = empty_members(tmp_path / "job.zip", 600_000)
    tracemalloc.start()
    try:
        with pytest.raises(JobArchiveError, match=r"more than 10000 members \(600000 declared"):
            unpack_job(archive, tmp_path / "dest")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak_bytes < 1 << 20, f"refusing took {peak_bytes} bytes"


def test_a_folder_whose_names_would_overflow_the_directory_limit_is_not_packed(tmp_path: Path) -> None:
    deep = tmp_path / "job" / "/".join(f"{level}" * 250 for level in range(10))  # 10 folders, each name longer
    deep.mkdir(parents=True)
    (deep / "a.txt").write_text("x")

    with pytest.raises(
        JobArchiveError, match=r"its names take \d+ bytes .* over the limit of 11264 \(shorten the paths\)"
    ):
        pack_job(tmp_path / "job", tmp_path / "job.zip", max_files=11)
