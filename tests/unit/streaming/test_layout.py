"""The stream of a downloadable is a valid safetensors file, served chunk by chunk without copies."""

from __future__ import annotations

import json
import struct
from collections import OrderedDict

import pytest
import safetensors.torch
import torch

from engine.errors import StreamingError
from engine.fobs.arrays import tensor_bytes
from engine.streaming.layout import StreamLayout


def mixed_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return OrderedDict(
        [
            ("layers.0.weight", torch.randn(33, 17, generator=generator)),
            ("mask", torch.tensor([True, False, True])),
            ("steps", torch.arange(5, dtype=torch.int64)),
            ("half", torch.randn(7, generator=generator).to(torch.bfloat16)),
            ("empty", torch.empty(0, 3)),
            ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ]
    )


def data_of(tensors: dict[str, torch.Tensor]):
    return lambda name: memoryview(tensor_bytes(tensors[name]))


def whole_stream(layout: StreamLayout, tensors: dict[str, torch.Tensor], chunk_bytes: int) -> bytes:
    return b"".join(
        bytes(piece)
        for i in range(layout.chunk_count(chunk_bytes))
        for piece in layout.chunk(i, chunk_bytes, data_of(tensors))
    )


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, 1 << 20], ids=lambda n: f"{n}B")
def test_chunks_join_into_a_file_safetensors_loads(chunk_bytes: int) -> None:
    tensors = mixed_tensors()
    layout = StreamLayout.of_tensors(tensors, metadata={"round": "3"})

    stream = whole_stream(layout, tensors, chunk_bytes)

    assert len(stream) == layout.total_bytes
    loaded = safetensors.torch.load(stream)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_data_offsets_stay_aligned_to_each_dtype() -> None:
    layout = StreamLayout.of_tensors(mixed_tensors())

    for entry in layout.entries:
        itemsize = {"F64": 8, "I64": 8, "F32": 4, "BF16": 2, "BOOL": 1}[entry.dtype]
        assert (layout.data_start + entry.begin) % itemsize == 0, entry


def test_chunks_are_views_of_the_tensor_memory() -> None:
    tensors = {"w": torch.zeros(1024)}
    layout = StreamLayout.of_tensors(tensors)
    pieces = layout.chunk(layout.chunk_count(4096) - 1, 4096, data_of(tensors))

    tensors["w"][-1] = 7.0

    assert bytes(pieces[-1])[-4:] == struct.pack("<f", 7.0)


def test_a_tensor_bigger_than_a_chunk_is_split() -> None:
    tensors = {"big": torch.arange(10_000, dtype=torch.float32)}
    layout = StreamLayout.of_tensors(tensors)

    sizes = [sum(p.nbytes for p in layout.chunk(i, 4096, data_of(tensors))) for i in range(layout.chunk_count(4096))]

    assert max(sizes) == 4096
    assert sum(sizes) == layout.total_bytes


def test_chunk_index_out_of_range() -> None:
    tensors = {"w": torch.zeros(4)}
    layout = StreamLayout.of_tensors(tensors)

    with pytest.raises(IndexError, match=r"chunk 5 is out of range: the stream has 1 chunks"):
        layout.chunk(5, 4096, data_of(tensors))


def test_parse_reads_back_what_of_tensors_wrote() -> None:
    layout = StreamLayout.of_tensors(mixed_tensors(), metadata={"a": "b"})

    parsed = StreamLayout.parse(layout.header)

    assert parsed == layout


def header(fields: dict) -> bytes:
    text = json.dumps(fields).encode()
    return struct.pack("<Q", len(text)) + text


LYING_HEADERS = [
    pytest.param(b"\x01\x02", r"shorter than its 8-byte length prefix", id="too-short"),
    pytest.param(
        struct.pack("<Q", 200 * 2**20) + b"{}", r"header of 209715200 bytes exceeds the limit", id="over-100MB"
    ),
    pytest.param(struct.pack("<Q", 50) + b"{}", r"header says 50 bytes but 2 arrived", id="length-lies"),
    pytest.param(struct.pack("<Q", 5) + b"{nope", r"not valid JSON", id="garbage-json"),
    pytest.param(
        header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}),
        r"tensor 'a': shape \[4\] of F32 needs 16 bytes, offsets give 8",
        id="size-mismatch",
    ),
    pytest.param(
        header(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            }
        ),
        r"tensor 'b' overlaps the tensor before it",
        id="overlap",
    ),
    pytest.param(
        header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}), r"tensor 'a' leaves a gap", id="gap"
    ),
    pytest.param(
        header({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}),
        r"tensor 'a': received a tensor of dtype 'Q9'",
        id="bad-dtype",
    ),
    pytest.param(
        header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}),
        r"tensor 'a': invalid shape \[-1\]",
        id="negative-shape",
    ),
    pytest.param(
        header({"a": {"dtype": "F32", "shape": [2]}}),
        r"tensor 'a': expected dtype, shape and data_offsets",
        id="missing-offsets",
    ),
    pytest.param(header({"__metadata__": {"k": 1}}), r"__metadata__ must map strings to strings", id="bad-metadata"),
    pytest.param(
        struct.pack("<Q", 2 * 49)
        + b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"U8"}}'.ljust(98),
        r"names 'a' twice",
        id="duplicate-name",
    ),
]


@pytest.mark.parametrize(("raw", "match"), LYING_HEADERS)
def test_a_header_that_lies_is_refused(raw: bytes, match: str) -> None:
    with pytest.raises(StreamingError, match=match):
        StreamLayout.parse(raw)
