"""Fuzzing the safetensors header and the placement of a stream's chunks.

Three decoders read safetensors bytes they did not write themselves:

- `StreamLayout.parse`: the header a sender announces for a download; it must give a layout
  whose entries tile the data section exactly, or raise `StreamingError`.
- `MemoryConsumer` / `DiskConsumer.accept`: the chunks a sender serves; each must be placed
  where the layout says or refused with `StreamingError`, and a completed download must hold
  exactly the bytes of the chunks accepted.
- `saved_tensor_refs`: a checkpoint file read back from disk; it must give references that
  read inside the file, or raise `ValueError` (or `OSError`), as documented.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from engine.errors import StreamingError
from engine.fobs.tensor_layout import LENGTH_PREFIX, TensorEntry, encode_header
from engine.persistors.saved_tensors import saved_tensor_refs
from engine.streaming.consumers import DiskConsumer, MemoryConsumer
from engine.streaming.layout import StreamLayout

from .strategies import EDGE_INTS, FUZZ, JSON_VALUES, mutated, scaled

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool]
TENSORS = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.builds(
        lambda dtype, shape, seed: (torch.arange(int(torch.tensor(shape).prod())) * seed).reshape(shape).to(dtype),
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 4), max_size=3),
        st.integers(1, 7),
    ),
    max_size=4,
)
METADATA = st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)
LAYOUTS = st.builds(StreamLayout.of_tensors, TENSORS, METADATA)


def stream_bytes(layout: StreamLayout, tensors: dict[str, torch.Tensor]) -> bytes:
    """The whole safetensors stream of ``tensors``: the header, then each tensor's bytes in order."""
    data = b"".join(
        tensors[e.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for e in layout.entries
    )
    return layout.header + data


def with_prefix(text: bytes) -> bytes:
    return LENGTH_PREFIX.pack(len(text)) + text


@st.composite
def json_level_changes(draw: st.DrawFn) -> bytes:
    """A valid header whose JSON had an entry's field (or the metadata) replaced by any JSON value."""
    layout = draw(LAYOUTS)
    fields: dict[str, Any] = json.loads(layout.header[LENGTH_PREFIX.size :])
    names = sorted(fields) or ["t"]
    name = draw(st.sampled_from(names))
    entry = fields.setdefault(name, {})
    change = draw(st.sampled_from(["field", "dims", "offsets", "entry", "drop key", "extra key"]))
    if change == "field" and isinstance(entry, dict):
        entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(JSON_VALUES)
    elif change == "dims" and isinstance(entry, dict):
        entry["shape"] = draw(st.lists(EDGE_INTS | st.integers(-2, 5) | st.floats(), max_size=6))
    elif change == "offsets" and isinstance(entry, dict):
        entry["data_offsets"] = draw(st.lists(EDGE_INTS | st.integers(-8, 64) | st.floats(), max_size=3))
    elif change == "entry":
        fields[name] = draw(JSON_VALUES)
    elif change == "drop key" and isinstance(entry, dict) and entry:
        del entry[draw(st.sampled_from(sorted(entry)))]
    else:
        fields[draw(st.text(max_size=5))] = draw(JSON_VALUES)
    return with_prefix(json.dumps(fields).encode())


HEADERS = (
    mutated(LAYOUTS.map(lambda layout: layout.header)) | json_level_changes() | st.binary(max_size=40).map(with_prefix)
)

DEEP_JSON = b"[" * 100_000
HUGE_SHAPE = json.dumps({"t": {"dtype": "F32", "shape": [2**62] * 20_000, "data_offsets": [0, 4]}}).encode()


@FUZZ
@given(header=HEADERS)
# Crashes found by this property: deep JSON raised RecursionError; a shape whose product has
# thousands of digits took seconds to check, and its error message raised ValueError.
@example(header=with_prefix(DEEP_JSON))
@example(header=with_prefix(HUGE_SHAPE))
@example(header=with_prefix(b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, Infinity]}}'))
@example(header=LENGTH_PREFIX.pack(2**64 - 1) + b"{}")
def test_parse_gives_a_tiling_layout_or_raises_streaming_error(header: bytes) -> None:
    try:
        layout = StreamLayout.parse(header)
    except StreamingError as e:
        assert str(e)
        return
    position = 0
    for entry in layout.entries:
        assert entry.begin == position and entry.end >= entry.begin
        position = entry.end
    assert layout.total_bytes == len(header) + position


@st.composite
def chunk_deliveries(draw: st.DrawFn) -> tuple[StreamLayout, bytes, int, list[tuple[int, list[bytes]]]]:
    """A layout, its stream, a chunk size, and the chunks as a sender serves them: some broken."""
    tensors = draw(TENSORS)
    layout = StreamLayout.of_tensors(tensors)
    stream = stream_bytes(layout, tensors)
    chunk_bytes = draw(st.sampled_from([1, 3, 8, 64, 4096]) | st.integers(1, max(len(stream), 1)))
    count = layout.chunk_count(chunk_bytes)
    order = draw(st.permutations(range(count))) if count <= 64 else list(range(count))
    deliveries = []
    for index in order:
        chunk = stream[index * chunk_bytes : (index + 1) * chunk_bytes]
        if draw(st.integers(0, 9)) == 0:  # one chunk in ten comes broken
            index = draw(st.sampled_from([index, index + count, -1, 2**63]) | EDGE_INTS)
            chunk = draw(mutated(st.just(chunk), max_mutations=2))
        cut = draw(st.integers(0, len(chunk)))  # chunks arrive split over frames anywhere
        deliveries.append((index, [chunk[:cut], chunk[cut:]]))
    if deliveries and draw(st.booleans()):
        deliveries.append(draw(st.sampled_from(deliveries)))  # a duplicate
    return layout, stream, chunk_bytes, deliveries


def place(consumer: Any, deliveries: list[tuple[int, list[bytes]]], chunk_bytes: int, size: int) -> bytes | None:
    """Offer every delivery; the stream the accepted ones make, or None when one was out of range."""
    accepted = bytearray(size)
    for index, frames in deliveries:
        try:
            consumer.accept(index, frames)
        except StreamingError as e:
            assert str(e)
            continue
        piece = b"".join(frames)
        accepted[index * chunk_bytes : index * chunk_bytes + len(piece)] = piece
    return bytes(accepted)


@scaled(25)
@given(delivery=chunk_deliveries())
def test_memory_consumer_places_accepted_chunks_and_refuses_the_rest(
    delivery: tuple[StreamLayout, bytes, int, list[tuple[int, list[bytes]]]],
) -> None:
    layout, stream, chunk_bytes, deliveries = delivery
    consumer = MemoryConsumer(layout, chunk_bytes)

    accepted = place(consumer, deliveries, chunk_bytes, len(stream))

    if not consumer.complete:
        try:
            consumer.finish()
        except StreamingError:
            return
        raise AssertionError("an incomplete download finished")
    tensors = consumer.finish()
    assert accepted is not None and accepted[: layout.data_start] == layout.header
    for entry in layout.entries:
        got = tensors[entry.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert got == accepted[layout.data_start + entry.begin : layout.data_start + entry.end], entry.name


@scaled(20)
@given(delivery=chunk_deliveries())
def test_disk_consumer_writes_exactly_the_accepted_chunks(
    delivery: tuple[StreamLayout, bytes, int, list[tuple[int, list[bytes]]]],
) -> None:
    layout, stream, chunk_bytes, deliveries = delivery
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        consumer = DiskConsumer(layout, chunk_bytes, Path(folder) / "t.safetensors")
        try:
            accepted = place(consumer, deliveries, chunk_bytes, len(stream))
            if consumer.complete:
                assert consumer.finish().read_bytes() == accepted
        finally:
            consumer.abort()


@st.composite
def checkpoint_files(draw: st.DrawFn) -> bytes:
    """A safetensors file as the persistor writes it, then broken in its bytes or its header's JSON."""
    tensors = draw(TENSORS)
    layout = StreamLayout.of_tensors(tensors)
    valid = stream_bytes(layout, tensors)
    if draw(st.booleans()):
        return draw(mutated(st.just(valid)))
    header = draw(json_level_changes())
    return header + valid[layout.data_start :]


@FUZZ
@given(content=checkpoint_files())
@example(content=with_prefix(DEEP_JSON))
@example(content=with_prefix(b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [Infinity, 4]}}') + bytes(8))
@example(content=with_prefix(b'{"t": {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]}}') + bytes(8))
@example(content=with_prefix(HUGE_SHAPE) + bytes(8))
@example(content=with_prefix(b'{"0": {"dtype": null, "shape": [], "data_offsets": [0, 4]}}'))  # SerializationError
def test_saved_tensor_refs_read_inside_the_file_or_raise_value_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        path = Path(folder) / "model.safetensors"
        path.write_bytes(content)
        try:
            refs = saved_tensor_refs(path)
        except ValueError as e:
            assert str(path) in str(e)
            return
        for ref in refs.values():
            tensor = ref.resolve()
            assert tensor.nbytes == ref.nbytes and ref.offset + ref.nbytes <= len(content)


def test_a_header_past_its_length_prefix_is_refused() -> None:
    entries = (TensorEntry("t", "F32", (1,), 0, 4),)
    header = encode_header(entries)

    assert struct.unpack("<Q", header[:8])[0] == len(header) - 8

    with pytest.raises(StreamingError, match=rf"header says {len(header) - 8} bytes but {len(header) - 7} arrived"):
        StreamLayout.parse(header + b" ")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        pytest.param(DEEP_JSON, "nests lists or objects too deeply", id="deep"),
        pytest.param(HUGE_SHAPE, r"shape \[4611686018427387904, .*\.\.\. holds more than", id="huge-shape"),
        pytest.param(
            b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551616]}}',
            r"invalid data_offsets \[0, 18446744073709551616\]",
            id="offset-past-u64",
        ),
    ],
)
def test_a_lying_header_is_refused_quickly_with_a_short_message(text: bytes, match: str) -> None:
    with pytest.raises(StreamingError, match=match) as refused:
        StreamLayout.parse(with_prefix(text))
    assert len(str(refused.value)) < 300


@pytest.mark.parametrize(
    ("text", "match"),
    [
        pytest.param(DEEP_JSON, "its header nests too deeply", id="deep"),
        pytest.param(
            b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [Infinity, 4]}}',
            "invalid data_offsets \\[inf, 4\\]",
            id="infinite",
        ),
        pytest.param(
            b'{"t": {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]}}',
            r"invalid shape \[-1, -1\]",
            id="negative",
        ),
        pytest.param(
            b'{"t": {"dtype": null, "shape": [], "data_offsets": [0, 4]}}',
            "tensor 't': received a tensor of dtype None",
            id="no-dtype",
        ),
        pytest.param(HUGE_SHAPE, "tensor 't' does not fit the file", id="huge-shape"),
        pytest.param(b'{"t": [1, 2]}', r"tensor 't' has an unreadable header entry \(\[1, 2\]\)", id="not-an-object"),
    ],
)
def test_a_damaged_checkpoint_header_raises_value_error_naming_the_file(
    tmp_path: Path, text: bytes, match: str
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(with_prefix(text) + bytes(8))

    with pytest.raises(ValueError, match=match) as refused:
        saved_tensor_refs(path)
    assert str(path) in str(refused.value)
