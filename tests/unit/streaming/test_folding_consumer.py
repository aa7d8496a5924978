"""`FoldingConsumer`: each tensor of a stream reaches the sink once complete, in any chunk order."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.aggregators.folding import FoldingModelAggregator
from engine.errors import ResultRefused, StreamingError
from engine.model import FLModel
from engine.streaming.folding import FoldingConsumer
from engine.streaming.layout import StreamLayout

from .test_consumers import chunks
from .test_layout import mixed_tensors


class Recorder:
    """A sink that rebuilds every tensor from the pieces it is handed (a test's view of what was folded)."""

    def __init__(self, refuse_layout: bool = False, layout_bug: bool = False) -> None:
        self.layout: dict | None = None
        self.flat: dict[str, torch.Tensor] = {}
        self.got: dict[str, torch.Tensor] = {}
        self.pieces = 0
        self.refuse_layout = refuse_layout
        self.layout_bug = layout_bug

    def check_layout(self, layout: dict) -> None:
        if self.refuse_layout:
            raise ResultRefused("shape (3,), expected (2,)")
        if self.layout_bug:
            raise ValueError("math domain error")  # a bug in the sink's check, not a refusal
        self.layout = dict(layout)
        self.flat = {name: torch.zeros(math.prod(shape), dtype=dtype) for name, (shape, dtype) in layout.items()}

    def fold_piece(self, item: str, start: int, values: torch.Tensor) -> None:
        assert item not in self.got
        self.flat[item][start : start + values.numel()] = values
        self.pieces += 1

    def complete(self, item: str) -> None:
        assert item not in self.got
        self.got[item] = self.flat[item].reshape(self.layout[item][0])


@pytest.mark.parametrize("chunk_bytes", [5, 64, 4096], ids=lambda n: f"{n}B")
def test_every_tensor_is_handed_on_complete_and_bitwise_in_any_order(chunk_bytes: int) -> None:
    tensors = mixed_tensors()
    layout = StreamLayout.of_tensors(tensors)
    arrivals = chunks(layout, tensors, chunk_bytes)
    random.Random(3).shuffle(arrivals)
    sink = Recorder()
    consumer = FoldingConsumer(StreamLayout.parse(layout.header), chunk_bytes, sink)

    assert sink.layout == {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    for index, frames in arrivals:
        consumer.accept(index, frames)
    result = consumer.finish()

    assert set(sink.got) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(sink.got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
        assert result[name].device.type == "meta" and result[name].shape == tensor.shape
        assert result[name].dtype == tensor.dtype


def test_a_refused_layout_fails_before_any_chunk() -> None:
    tensors = {"w": torch.ones(3)}
    layout = StreamLayout.of_tensors(tensors)
    with pytest.raises(StreamingError, match="shape"):
        FoldingConsumer(layout, 8, Recorder(refuse_layout=True))


def test_a_bug_in_the_sink_goes_up_as_itself_not_as_a_refused_stream() -> None:
    layout = StreamLayout.of_tensors({"w": torch.ones(3)})

    with pytest.raises(ValueError, match="math domain error") as caught:
        FoldingConsumer(layout, 8, Recorder(layout_bug=True))

    assert not isinstance(caught.value, (StreamingError, ResultRefused))


def test_pieces_go_on_as_chunks_land_and_a_tensor_completes_with_its_last_byte() -> None:
    tensors = {"a": torch.arange(4, dtype=torch.float32), "b": torch.arange(8, dtype=torch.float32)}
    layout = StreamLayout.of_tensors(tensors)
    sink = Recorder()
    consumer = FoldingConsumer(layout, 16, sink)
    arrivals = chunks(layout, tensors, 16)

    for index, frames in arrivals[:-1]:  # all but the stream's last chunk: "b" is incomplete
        consumer.accept(index, frames)
    assert set(sink.got) == {"a"} and sink.pieces >= 3  # "b" went on in pieces already
    consumer.abort()
    with pytest.raises(StreamingError):
        consumer.accept(*arrivals[-1])
    assert set(sink.got) == {"a"}


def test_elements_that_straddle_chunks_are_staged_whole() -> None:
    tensors = {"odd": torch.arange(3, dtype=torch.uint8), "w": torch.randn(50, dtype=torch.float64)}
    layout = StreamLayout.of_tensors(tensors)
    sink = Recorder()
    consumer = FoldingConsumer(layout, 12, sink)  # 12 is no multiple of 8, and "w" starts at an odd offset

    for index, frames in chunks(layout, tensors, 12):
        consumer.accept(index, frames)
    consumer.finish()

    assert all(torch.equal(sink.got[n], t) for n, t in tensors.items())


def test_a_stream_folds_into_the_aggregator_exactly_and_a_midway_failure_taints_it() -> None:
    generator = torch.Generator().manual_seed(0)
    results = {
        f"site-{k}": {"w": torch.randn(300, generator=generator), "b": torch.randn(7, generator=generator)}
        for k in (1, 2, 3)
    }
    steps = {"site-1": 3, "site-2": 5, "site-3": 11}
    aggregator = FoldingModelAggregator()
    for site in ("site-1", "site-2"):
        tensors = results[site]
        layout = StreamLayout.of_tensors(tensors)
        fold = aggregator.open_result(FLModel(meta={"NUM_STEPS_CURRENT_ROUND": steps[site]}), site)
        consumer = FoldingConsumer(layout, 64, fold)
        for index, frames in chunks(layout, tensors, 64):
            consumer.accept(index, frames)
        aggregator.accept_model(FLModel(params=consumer.finish()), site)

    mean = aggregator.aggregate_model().params
    for name in ("w", "b"):
        expected = (3 * results["site-1"][name].double() + 5 * results["site-2"][name].double()) / 8
        assert torch.allclose(mean[name].double(), expected, rtol=0, atol=1e-6)

    # site-3 dies after some of its chunks were folded: the sum is tainted, no mean comes from it
    tensors = results["site-3"]
    layout = StreamLayout.of_tensors(tensors)
    fold = aggregator.open_result(FLModel(meta={"NUM_STEPS_CURRENT_ROUND": 11}), "site-3")
    consumer = FoldingConsumer(layout, 64, fold)
    arrivals = chunks(layout, tensors, 64)
    for index, frames in arrivals[: len(arrivals) // 2]:
        consumer.accept(index, frames)
    assert consumer.pieces >= 1
    consumer.abort()
    fold.fail("client died")
    assert aggregator.tainted() == {"site-3": "client died"}
    with pytest.raises(RuntimeError, match="parts of failed results"):
        aggregator.aggregate_model()
