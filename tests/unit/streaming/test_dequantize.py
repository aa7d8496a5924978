"""Quantized streams: the sender makes records per chunk, the receiver decodes them into any consumer.

No network here (the chunks are handed from a `TensorDownloadable` to the consumer directly, in
shuffled order); `tests/integration/streaming/test_quantized.py` sends them between real cells.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.errors import SerializationError, StreamingError
from engine.fobs.quantized import CODECS, FP16_MAX, INT8_BLOCK, QUANTIZED_METADATA_KEY, QuantizedTensor
from engine.streaming import downloadable
from engine.streaming.consumers import DiskConsumer, MemoryConsumer
from engine.streaming.dequantize import DECODE_SLICE_BYTES, DequantizingConsumer, plan_of
from engine.streaming.downloadable import TensorDownloadable
from engine.streaming.folding import FoldingConsumer
from engine.streaming.layout import StreamLayout
from engine.streaming.pull import ByteBudget

from .test_folding_consumer import Recorder

MODES = list(CODECS)


def model() -> dict[str, torch.Tensor]:
    """Float tensors of several dtypes and sizes (one spans several int8 blocks), and ones that stay exact."""
    generator = torch.Generator().manual_seed(7)
    return {
        "conv.weight": torch.randn(3 * INT8_BLOCK + 17, generator=generator) * 0.05,
        "fc.weight": torch.randn(40, 30, generator=generator, dtype=torch.float64),
        "fc.bias": torch.randn(30, generator=generator).to(torch.bfloat16),
        "zeros": torch.zeros(INT8_BLOCK + 1),
        "empty": torch.zeros(0),
        "bn.num_batches_tracked": torch.tensor(12),
        "labels": torch.arange(5, dtype=torch.int32),
    }


def quantized(tensors: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor | QuantizedTensor]:
    return {name: QuantizedTensor(t, mode) if t.is_floating_point() else t for name, t in tensors.items()}


def receive(downloadable: TensorDownloadable, make_inner, seed: int = 1) -> object:
    """Every chunk of ``downloadable``, shuffled, into a `DequantizingConsumer` around ``make_inner``."""
    wire = StreamLayout.parse(downloadable.layout.header)
    plan = plan_of(wire)
    inner = make_inner(plan.logical, plan.logical_chunk_bytes(downloadable.chunk_bytes))
    consumer = DequantizingConsumer(wire, downloadable.chunk_bytes, plan, inner)
    order = list(range(downloadable.chunk_count))
    random.Random(seed).shuffle(order)
    for index in order:
        consumer.accept(index, downloadable.chunk(index))
    return consumer.finish()


def bound(original: torch.Tensor, mode: str) -> float:
    """The largest error ``mode`` allows for ``original`` (int8: per block, bounded by the tensor's largest)."""
    largest = original.double().abs().max().item() if original.numel() else 0.0
    return CODECS[mode].max_relative_error * largest * 1.0001 + 1e-30


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk_bytes", [777, 4096, 1 << 20], ids=lambda n: f"{n}B")
def test_values_come_back_in_their_dtype_and_shape_within_the_modes_bound(mode: str, chunk_bytes: int) -> None:
    tensors = model()
    received = receive(TensorDownloadable(quantized(tensors, mode), chunk_bytes), MemoryConsumer)

    assert set(received) == set(tensors)
    for name, original in tensors.items():
        got = received[name]
        assert got.dtype == original.dtype and got.shape == original.shape, name
        if not original.is_floating_point():
            assert torch.equal(got, original), name
            continue
        error = (got.double() - original.double()).abs().max().item() if original.numel() else 0.0
        assert error <= bound(original, mode), (name, error)
    assert torch.equal(received["zeros"], tensors["zeros"])  # a block of zeros has no NaN scale


def test_int8_blocks_scale_on_their_own() -> None:
    """A block of small values keeps its precision beside a block of large ones (a scale per block)."""
    tensor = torch.cat([torch.full((INT8_BLOCK,), 1000.0), torch.linspace(-1e-3, 1e-3, INT8_BLOCK)])
    received = receive(TensorDownloadable({"w": QuantizedTensor(tensor, "int8")}, 4096), MemoryConsumer)
    small = received["w"][INT8_BLOCK:]
    assert (small - tensor[INT8_BLOCK:]).abs().max().item() <= 1e-3 / 254 * 1.0001


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("largest", [1e-30, 1e-38, 2e-39])
def test_a_block_of_tiny_values_keeps_its_bound_and_its_zeros(mode: str, largest: float) -> None:
    """Below about 3e-39 a block's scale has no float32 inverse: values are divided by it instead."""
    tensor = torch.zeros(INT8_BLOCK)
    tensor[1::3] = largest
    tensor[2::3] = -largest / 3
    received = receive(TensorDownloadable({"w": QuantizedTensor(tensor, mode)}, 4096), MemoryConsumer)
    assert torch.equal(received["w"][0::3], tensor[0::3])  # the zeros
    assert (received["w"] - tensor).abs().max().item() <= CODECS[mode].max_relative_error * largest * 1.0001


@pytest.mark.parametrize(("mode", "ratio"), [("fp16", 0.501), ("bf16", 0.501), ("int8", 0.251), ("int4", 0.126)])
def test_the_wire_carries_the_modes_bytes(mode: str, ratio: float) -> None:
    tensor = torch.randn(1 << 20)
    plain = TensorDownloadable({"w": tensor}, 1 << 20)
    sent = TensorDownloadable({"w": QuantizedTensor(tensor, mode)}, 1 << 20)
    served = sum(sum(piece.nbytes for piece in sent.chunk(i)) for i in range(sent.chunk_count))

    assert served == sent.layout.total_bytes
    assert served <= plain.layout.total_bytes * ratio
    assert not sent.in_memory  # records are made per chunk: the service must not serve them on its I/O thread


@pytest.mark.parametrize("mode", MODES)
def test_a_folding_sum_gets_the_decoded_values(mode: str) -> None:
    tensors = {"w": torch.randn(2 * INT8_BLOCK + 5), "b": torch.randn(7)}
    sink = Recorder()
    folded = receive(
        TensorDownloadable(quantized(tensors, mode), 4096),
        lambda layout, chunk_bytes: FoldingConsumer(layout, chunk_bytes, sink),
    )

    assert sink.layout == {name: (tuple(t.shape), torch.float32) for name, t in tensors.items()}
    assert all(t.is_meta for t in folded.values())
    for name, original in tensors.items():
        assert (sink.got[name] - original).abs().max().item() <= bound(original, mode)


def test_download_to_disk_writes_the_decoded_values_as_safetensors(tmp_path: Path) -> None:
    tensors = model()
    path = receive(
        TensorDownloadable(quantized(tensors, "int8"), 4096),
        lambda layout, chunk_bytes: DiskConsumer(layout, chunk_bytes, tmp_path / "received.safetensors"),
    )

    on_disk = load_file(path)
    for name, original in tensors.items():
        assert on_disk[name].dtype == original.dtype and on_disk[name].shape == original.shape
        if original.numel():
            assert (on_disk[name].double() - original.double()).abs().max().item() <= bound(original, "int8")
    assert (
        path.stat().st_size
        == plan_of(
            StreamLayout.parse(TensorDownloadable(quantized(tensors, "int8"), 4096).layout.header)
        ).logical.total_bytes
    )


def test_a_non_finite_value_stays_non_finite() -> None:
    """A NaN or an infinity must reach the receiver's finite check, not be rounded into a number."""
    for mode in MODES:
        for bad in (math.nan, math.inf):
            tensor = torch.zeros(10)
            tensor[3] = bad
            received = receive(TensorDownloadable({"w": QuantizedTensor(tensor, mode)}, 4096), MemoryConsumer)
            assert not torch.isfinite(received["w"]).all(), (mode, bad)


def test_a_non_contiguous_tensor_is_sent_by_its_values() -> None:
    tensor = torch.randn(64, 33).t()
    received = receive(TensorDownloadable({"w": QuantizedTensor(tensor, "bf16")}, 1000), MemoryConsumer)
    assert (received["w"] - tensor).abs().max().item() <= bound(tensor, "bf16")


def test_only_float_tensors_can_be_quantized() -> None:
    with pytest.raises(SerializationError, match="only float tensors"):
        QuantizedTensor(torch.arange(3), "int8")
    with pytest.raises(SerializationError, match="unknown quantization mode 'int2'"):
        QuantizedTensor(torch.zeros(3), "int2")
    assert FP16_MAX == 65504.0


def hostile(listing: object, dtype: str = "U8", nbytes: int = 4096 + 4) -> StreamLayout:
    """A received layout whose metadata lists ``listing`` for one entry ``w``."""
    from engine.fobs.tensor_layout import TensorEntry, encode_header

    entries = (TensorEntry("w", dtype, (nbytes if dtype == "U8" else nbytes // 2,), 0, nbytes),)
    return StreamLayout.parse(encode_header(entries, {QUANTIZED_METADATA_KEY: json.dumps(listing)}))


@pytest.mark.parametrize(
    ("listing", "dtype", "message"),
    [
        ({"x": ["int8", "F32", [10]]}, "U8", "no such entry"),
        ({"w": ["int2", "F32", [10]]}, "U8", "unknown quantization mode"),
        ({"w": ["int8", "I64", [10]]}, "U8", "not one a tensor is quantized from"),
        ({"w": ["int8", "F32", [-1]]}, "U8", "invalid shape"),
        ({"w": ["int8", "F32", [10**12]]}, "U8", "take"),  # claims far more values than the bytes hold
        ({"w": ["fp16", "F32", [2050]]}, "U8", "travels as F16"),
        ({"w": "int8"}, "U8", "expected \\[mode, dtype, shape\\]"),
        ([], "U8", "non-empty JSON object"),
    ],
)
def test_metadata_that_does_not_match_the_stream_is_refused(listing: object, dtype: str, message: str) -> None:
    with pytest.raises(StreamingError, match=message):
        plan_of(hostile(listing, dtype))


def hostile_shape(shape: list[int], wire_dtype: str = "F16", logical: str = "F32") -> StreamLayout:
    """A layout whose listing gives quantized entry ``w`` (4 wire bytes) the logical ``shape``."""
    from engine.fobs.tensor_layout import TensorEntry, encode_header

    mode = "fp16" if wire_dtype == "F16" else "int8"
    entries = (TensorEntry("w", wire_dtype, (4 if wire_dtype == "U8" else 2,), 0, 4),)
    listing = {"w": [mode, logical, shape]}
    return StreamLayout.parse(encode_header(entries, {QUANTIZED_METADATA_KEY: json.dumps(listing)}))


def test_a_shape_of_millions_of_dims_is_refused_at_once() -> None:
    """Its full product would have millions of digits (a minute of CPU with the GIL held, per reply)."""
    started = time.monotonic()
    with pytest.raises(StreamingError, match="more than 2\\*\\*64 - 1 values"):
        plan_of(hostile_shape([3] * 1_600_000))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        # 2**62 values in fp16 are 2**63 wire bytes, and 2**65 bytes as float64: no tensor holds them.
        (lambda: hostile({"w": ["fp16", "F64", [2**62]]}, "F16", 2**63), "larger than any tensor"),
        (lambda: plain_beside_quantized(2**63), "larger than any tensor"),
    ],
)
def test_sizes_no_tensor_can_hold_are_refused_as_the_senders_fault(layout, message: str) -> None:
    with pytest.raises(StreamingError, match=message):
        plan_of(layout())


def plain_beside_quantized(plain_bytes: int) -> StreamLayout:
    """A plain byte entry of ``plain_bytes`` after a small quantized one."""
    from engine.fobs.tensor_layout import TensorEntry, encode_header

    entries = (TensorEntry("q", "F16", (2,), 0, 4), TensorEntry("p", "U8", (plain_bytes,), 4, 4 + plain_bytes))
    listing = {"q": ["fp16", "F32", [2]]}
    return StreamLayout.parse(encode_header(entries, {QUANTIZED_METADATA_KEY: json.dumps(listing)}))


@pytest.mark.parametrize("chunk_bytes", [4098, 6002, 1001])
def test_plain_entries_of_a_quantized_stream_reach_a_fold_in_whole_elements(chunk_bytes: int) -> None:
    """A chunk size that is no multiple of a plain entry's item size: its elements straddle chunks."""
    generator = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(20_000, generator=generator), "bias": torch.randn(3000, generator=generator)}
    tensors["steps"] = torch.arange(777, dtype=torch.int64)
    sent = TensorDownloadable({**tensors, "w": QuantizedTensor(tensors["w"], "int8")}, chunk_bytes)
    for seed in range(3):
        sink = Recorder()
        receive(sent, lambda layout, chunk, sink=sink: FoldingConsumer(layout, chunk, sink), seed)
        assert torch.equal(sink.got["bias"], tensors["bias"])
        assert torch.equal(sink.got["steps"], tensors["steps"])
        assert (sink.got["w"] - tensors["w"]).abs().max().item() <= bound(tensors["w"], "int8")


@pytest.mark.parametrize("mode", ["int4", "bf16"])
def test_a_sender_s_huge_chunks_are_decoded_a_slice_at_a_time(mode: str) -> None:
    """One chunk for the whole stream (the sender's say): what a fold is handed at once, and the
    receiver's scratch, stay those of a slice of `DECODE_SLICE_BYTES`, whatever the model's size."""
    tensor = torch.randn(6 << 20).to(torch.bfloat16)  # int4: 3 MiB on the wire; bf16: 12 MiB
    sent = TensorDownloadable({"w": QuantizedTensor(tensor, mode)}, 1 << 40)
    plan = plan_of(StreamLayout.parse(sent.layout.header))
    growth = math.ceil(2 * 8 / CODECS[mode].bits)  # wire bytes -> bytes of bfloat16 values
    assert plan.logical_chunk_bytes(1 << 40) <= DECODE_SLICE_BYTES * growth + 8

    pieces: list[int] = []
    sink = Recorder()
    fold_piece = sink.fold_piece
    sink.fold_piece = lambda item, start, values: pieces.append(values.numel()) or fold_piece(item, start, values)
    receive(sent, lambda layout, chunk: FoldingConsumer(layout, chunk, sink))

    assert len(pieces) >= 3 and max(pieces) * 2 <= DECODE_SLICE_BYTES * growth
    assert (sink.got["w"].float() - tensor.float()).abs().max().item() <= bound(tensor, mode) + 1e-2


def test_a_budget_is_charged_the_decoded_size() -> None:
    """4 bytes on the wire become 16 here: a sender cannot make a receiver hold 4x what it announced."""
    tensor = torch.randn(1 << 16)
    sent = TensorDownloadable({"w": QuantizedTensor(tensor, "int8")}, 4096)
    plan = plan_of(StreamLayout.parse(sent.layout.header))
    assert plan.logical.total_bytes > 3.9 * sent.layout.total_bytes
    budget = ByteBudget(sent.layout.total_bytes * 2, "a result of site-1")
    with pytest.raises(StreamingError, match="more than a result of site-1 may hold"):
        budget.take(max(sent.layout.total_bytes, plan.logical.total_bytes), "download 'r'")


def test_records_that_straddle_chunks_are_put_together_in_any_order() -> None:
    tensor = torch.randn(5 * INT8_BLOCK)
    sent = TensorDownloadable({"w": QuantizedTensor(tensor, "int8")}, 1500)  # every record straddles
    for seed in range(3):
        received = receive(sent, MemoryConsumer, seed)
        assert (received["w"] - tensor).abs().max().item() <= bound(tensor, "int8")


def test_a_wire_range_is_made_from_the_records_it_needs_only() -> None:
    tensor = torch.randn(100 * INT8_BLOCK)
    whole = np.frombuffer(QuantizedTensor(tensor, "int8").wire_range(0, 100 * 4096), dtype=np.uint8)
    part = QuantizedTensor(tensor, "int8").wire_range(5000, 9000)
    assert bytes(part) == whole[5000:9000].tobytes()


@pytest.mark.parametrize("mode", MODES)
def test_neither_side_holds_a_second_model(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak resident memory: the sender makes a chunk's records at a time (keeping a bounded few for
    other receivers), the receiver holds the values only."""
    from tests.unit.aggregators.test_robust_memory import peak_growth

    monkeypatch.setattr(downloadable, "WIRE_CACHE_BYTES", 4 << 20)  # below every mode's wire size here
    size = 64 << 20
    tensor = torch.randn(size // 4)
    sent = TensorDownloadable({"w": QuantizedTensor(tensor, mode)}, 1 << 20)

    _, serving = peak_growth(lambda: [bytes(b"".join(sent.chunk(i))) and None for i in range(sent.chunk_count)])
    received, receiving = peak_growth(lambda: receive(sent, MemoryConsumer))

    assert serving < (4 + 16) << 20, f"serving grew by {serving >> 20} MiB"
    # The values, and the sender's side too (it runs in this process: its wire cache, each chunk's
    # records) with a chunk's scratch: 12-16 MiB over the values, by what earlier tests left on
    # the heap. A second model (64 MiB), or the fp16 / bf16 wire whole (32 MiB), is well over.
    assert receiving < size + (24 << 20), f"receiving grew by {receiving >> 20} MiB"
    assert received["w"].shape == tensor.shape


def test_a_huge_announced_chunk_size_reserves_nothing_beyond_the_stream() -> None:
    """The chunk size is the sender's say: scratch and the inner consumer's chunk are bounded by the stream."""
    tensor = torch.randn(1000)
    sent = TensorDownloadable({"w": QuantizedTensor(tensor, "int8")}, 1 << 40)
    plan = plan_of(StreamLayout.parse(sent.layout.header))
    assert plan.logical_chunk_bytes(1 << 40) <= plan.logical.total_bytes + 8
    received = receive(sent, MemoryConsumer)
    assert (received["w"] - tensor).abs().max().item() <= bound(tensor, "int8")


def test_a_second_receiver_gets_the_records_the_first_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records are made once for receivers that ask for the same chunk close together."""
    made = []
    wire_range = QuantizedTensor.wire_range
    monkeypatch.setattr(QuantizedTensor, "wire_range", lambda self, a, b: made.append((a, b)) or wire_range(self, a, b))
    tensor = torch.randn(1 << 16)
    sent = TensorDownloadable({"w": QuantizedTensor(tensor, "int8")}, 4096)
    first = receive(sent, MemoryConsumer, seed=1)
    second = receive(sent, MemoryConsumer, seed=2)

    assert torch.equal(first["w"], second["w"])
    assert len(made) == len(set(made))  # the second receiver's chunks all came from the first's
    sent.release()
    assert sent._wire_bytes == 0  # noqa: SLF001 - released with the offer
