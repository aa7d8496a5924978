"""Chunks land in preallocated tensors or a safetensors file, in any order, checked one by one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import safetensors.torch
import torch

from engine.errors import StreamingError
from engine.fobs.arrays import tensor_bytes
from engine.fobs.page_populator import PAGE_POPULATOR
from engine.streaming.consumers import DiskConsumer, MemoryConsumer
from engine.streaming.layout import StreamLayout

from .test_layout import mixed_tensors


def chunks(layout: StreamLayout, tensors: dict[str, torch.Tensor], chunk_bytes: int) -> list[tuple[int, list[bytes]]]:
    """Every chunk as bytes frames, as they would arrive from the network."""
    data_of = lambda name: memoryview(tensor_bytes(tensors[name]))  # noqa: E731
    return [
        (i, [bytes(p) for p in layout.chunk(i, chunk_bytes, data_of)]) for i in range(layout.chunk_count(chunk_bytes))
    ]


@pytest.mark.parametrize("chunk_bytes", [5, 64, 4096], ids=lambda n: f"{n}B")
def test_memory_consumer_rebuilds_every_tensor_bitwise_in_any_order(chunk_bytes: int) -> None:
    tensors = mixed_tensors()
    layout = StreamLayout.of_tensors(tensors)
    arrivals = chunks(layout, tensors, chunk_bytes)
    random.Random(1).shuffle(arrivals)
    consumer = MemoryConsumer(StreamLayout.parse(layout.header), chunk_bytes)

    for index, frames in arrivals:
        consumer.accept(index, frames)
    result = consumer.finish()

    assert set(result) == set(tensors)
    for name, tensor in tensors.items():
        assert result[name].dtype == tensor.dtype and result[name].shape == tensor.shape
        assert torch.equal(result[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_disk_consumer_writes_a_file_safetensors_loads(tmp_path: Path) -> None:
    tensors = mixed_tensors()
    layout = StreamLayout.of_tensors(tensors)
    consumer = DiskConsumer(layout, 100, tmp_path / "model.safetensors")

    for index, frames in reversed(chunks(layout, tensors, 100)):
        consumer.accept(index, frames)
    path = consumer.finish()

    loaded = safetensors.torch.load_file(path)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


@pytest.mark.parametrize(
    ("arrivals", "match"),
    [
        pytest.param([(0, None), (0, None)], r"chunk 0 arrived twice", id="duplicate"),
        pytest.param([(99, [b""])], r"chunk 99 is out of range: the stream has \d+ chunks", id="out-of-range"),
        pytest.param([(1, [b"short"])], r"chunk 1 has 5 bytes, expected 64", id="wrong-size"),
    ],
)
def test_bad_chunks_are_refused(arrivals: list, match: str) -> None:
    tensors = mixed_tensors()
    layout = StreamLayout.of_tensors(tensors)
    good = dict(chunks(layout, tensors, 64))
    consumer = MemoryConsumer(layout, 64)

    with pytest.raises(StreamingError, match=match):
        for index, frames in arrivals:
            consumer.accept(index, frames if frames is not None else good[index])


def test_finish_before_every_chunk_names_what_is_missing(tmp_path: Path) -> None:
    tensors = mixed_tensors()
    layout = StreamLayout.of_tensors(tensors)
    consumer = DiskConsumer(layout, 64, tmp_path / "partial.safetensors")
    consumer.accept(0, dict(chunks(layout, tensors, 64))[0])

    with pytest.raises(
        StreamingError,
        match=rf"download incomplete: {layout.chunk_count(64) - 1} of {layout.chunk_count(64)} chunks missing \(first 1\)",
    ):
        consumer.finish()


def test_abort_removes_the_partial_file(tmp_path: Path) -> None:
    tensors = mixed_tensors()
    layout = StreamLayout.of_tensors(tensors)
    consumer = DiskConsumer(layout, 64, tmp_path / "partial.safetensors")
    consumer.accept(0, dict(chunks(layout, tensors, 64))[0])

    consumer.abort()
    consumer.abort()  # twice is harmless

    assert list(tmp_path.iterdir()) == []


def test_a_header_chunk_that_differs_from_the_announced_one_is_refused() -> None:
    tensors = {"w": torch.zeros(4)}
    layout = StreamLayout.of_tensors(tensors)
    index, frames = chunks(layout, tensors, 1024)[0]
    forged = bytearray(b"".join(frames))
    forged[10] ^= 0xFF

    with pytest.raises(StreamingError, match=r"the streamed header differs from the one announced"):
        MemoryConsumer(layout, 1024).accept(index, [bytes(forged)])


def test_a_second_download_lands_in_the_memory_of_a_dropped_first_one() -> None:
    tensors = {"weight": torch.randn(512, 1024), "bias": torch.randn(16)}
    layout = StreamLayout.of_tensors(tensors)
    arrivals = chunks(layout, tensors, 1 << 20)

    def download() -> dict[str, torch.Tensor]:
        consumer = MemoryConsumer(StreamLayout.parse(layout.header), 1 << 20)
        for index, frames in arrivals:
            consumer.accept(index, frames)
        return consumer.finish()

    first = download()
    address = first["weight"].data_ptr()
    kept = download()  # the first is still held: new memory
    assert kept["weight"].data_ptr() != address
    assert PAGE_POPULATOR.wait_idle()  # it holds a new tensor for as long as it maps its pages
    del first

    second = download()

    assert second["weight"].data_ptr() == address
    assert torch.equal(second["weight"], tensors["weight"]) and torch.equal(kept["weight"], tensors["weight"])
