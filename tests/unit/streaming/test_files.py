"""Files as downloads, without sockets: served byte ranges, reassembly on disk, deletion."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.errors import StreamingError
from engine.streaming.consumers import FileConsumer
from engine.streaming.downloadable import FileDownloadable
from engine.streaming.transactions import DownloadRegistry

CONTENT = os.urandom(10_000)


@pytest.fixture
def owned(tmp_path: Path) -> tuple[Path, Path]:
    """A folder of the sender's holding one file; returns (folder, file)."""
    folder = tmp_path / "send"
    folder.mkdir()
    path = folder / "object.bin"
    path.write_bytes(CONTENT)
    return folder, path


@pytest.mark.parametrize("chunk_bytes", [1024, 10_000, 4096, 1 << 20], ids=["many", "exact", "short-last", "one"])
def test_the_chunks_of_a_file_are_its_bytes(owned: tuple[Path, Path], chunk_bytes: int) -> None:
    _, path = owned
    served = FileDownloadable(path, chunk_bytes)

    stream = b"".join(bytes(piece) for index in range(served.chunk_count) for piece in served.chunk(index))

    assert stream == CONTENT
    header, frames = served.info()
    assert header == {
        "kind": "file",
        "chunk_bytes": chunk_bytes,
        "chunk_count": served.chunk_count,
        "size_bytes": 10_000,
    }
    assert frames == []


def test_an_empty_file_has_no_chunks(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.touch()

    assert FileDownloadable(path, 1024).chunk_count == 0


def test_release_deletes_the_owned_folder_and_refuses_further_chunks(owned: tuple[Path, Path]) -> None:
    folder, path = owned
    served = FileDownloadable(path, 1024, owned_folder=folder)

    served.release()
    served.release()  # twice is harmless

    assert not folder.exists()
    with pytest.raises(StreamingError, match=r"the download was released while a chunk was being served"):
        served.chunk(0)


def test_release_without_an_owned_folder_deletes_just_the_file(owned: tuple[Path, Path]) -> None:
    folder, path = owned

    FileDownloadable(path, 1024).release()

    assert folder.exists() and not path.exists()


def test_a_file_consumer_rebuilds_the_file_from_chunks_in_any_order(owned: tuple[Path, Path], tmp_path: Path) -> None:
    _, path = owned
    served = FileDownloadable(path, 1000)
    consumer = FileConsumer(served.size_bytes, 1000, tmp_path / "received.bin")

    for index in reversed(range(served.chunk_count)):
        consumer.accept(index, served.chunk(index))

    assert consumer.finish().read_bytes() == CONTENT


@pytest.mark.parametrize(
    ("index", "frames", "match"),
    [
        pytest.param(10, [b"x" * 1000], r"chunk 10 is out of range: the stream has 10 chunks", id="out-of-range"),
        pytest.param(0, [b"x" * 999], r"chunk 0 has 999 bytes, expected 1000", id="short"),
    ],
)
def test_a_file_consumer_refuses_chunks_that_do_not_fit(
    tmp_path: Path, index: int, frames: list[bytes], match: str
) -> None:
    consumer = FileConsumer(10_000, 1000, tmp_path / "received.bin")

    with pytest.raises(StreamingError, match=match):
        consumer.accept(index, frames)
    consumer.abort()

    assert list(tmp_path.iterdir()) == []


def test_an_aborted_file_consumer_deletes_its_partial_file(tmp_path: Path) -> None:
    consumer = FileConsumer(10_000, 1000, tmp_path / "received.bin")
    consumer.accept(0, [b"x" * 1000])

    with pytest.raises(StreamingError, match=r"download incomplete: 9 of 10 chunks missing \(first 1\)"):
        consumer.finish()
    consumer.abort()
    consumer.abort()

    assert list(tmp_path.iterdir()) == []


def test_a_closed_registry_refuses_new_offers_and_the_caller_keeps_them(owned: tuple[Path, Path]) -> None:
    folder, path = owned
    registry = DownloadRegistry()
    registry.close()

    with pytest.raises(StreamingError, match=r"the download service is closed: nothing more can be offered"):
        registry.add(FileDownloadable(path, 1024, owned_folder=folder), ["site-1"], timeout_s=60)

    assert path.exists()
