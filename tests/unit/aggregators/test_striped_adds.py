"""Results folded from many threads at once (`StripedAdds`): the same mean, and nothing reads a sum mid-add."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.aggregators import WeightedModelAggregator, folding, striped_adds
from engine.aggregators.folding import FoldingModelAggregator
from engine.aggregators.striped_adds import StripedAdds
from engine.model import FLModel

SITES = [f"site-{k}" for k in range(1, 9)]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_001, generator=generator), "b": torch.randn(7, generator=generator)}


def _new_sum(numel: int, fill: float = 0.0, blank: bool = False) -> tuple[StripedAdds, torch.Tensor, object]:
    """A sum ``w`` of ``numel`` elements, its `StripedAdds`, and one add begun into it (as the aggregator
    does under its lock: one thread here, so no lock)."""
    adds = StripedAdds()
    flat = torch.full((numel,), fill)
    return adds, flat, adds.begin("w", numel, blank=blank)


def _stream_in_chunks(aggregator: FoldingModelAggregator, site: str, tensors: dict, steps: int, chunk: int) -> None:
    fold = aggregator.open_result(FLModel(meta={"NUM_STEPS_CURRENT_ROUND": steps}), site)
    fold.check_layout({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    for name, tensor in tensors.items():
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), chunk):  # chunks that straddle stripes
            fold.fold_piece(name, start, flat[start : start + chunk])
        fold.complete(name)
    placeholders = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}
    aggregator.accept_model(FLModel(params=placeholders, meta={"NUM_STEPS_CURRENT_ROUND": steps}), site)


def test_eight_results_folded_by_eight_threads_give_the_sequential_mean(monkeypatch) -> None:
    monkeypatch.setattr(striped_adds, "STRIPE_ELEMENTS", 4096)  # many stripes, many chunks across them
    results = {site: _tensors(k) for k, site in enumerate(SITES, start=1)}
    sequential, concurrent = FoldingModelAggregator(), FoldingModelAggregator()
    for k, site in enumerate(SITES, start=1):
        _stream_in_chunks(sequential, site, results[site], k, chunk=5000)
    start = threading.Barrier(len(SITES))

    def fold(k: int, site: str) -> None:
        start.wait()
        _stream_in_chunks(concurrent, site, results[site], k, chunk=5000)

    threads = [threading.Thread(target=fold, args=(k, site)) for k, site in enumerate(SITES, start=1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    expected, got = sequential.aggregate_model().params, concurrent.aggregate_model().params
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=0, atol=1e-6), name


def test_an_add_in_flight_holds_back_whatever_reads_the_sums_whole() -> None:
    lock = threading.Lock()
    adds = StripedAdds()
    flat = torch.zeros(10)
    with lock:
        stripes = adds.begin("w", flat.numel())
    stripes.locks[0].acquire()  # the add will wait on its stripe: it is in flight meanwhile
    adding = threading.Thread(target=adds.add, args=(stripes, flat, 2, torch.ones(3), 2.0))
    adding.start()
    drained = threading.Event()

    def drain() -> None:
        with lock:
            adds.drain()
            drained.set()

    draining = threading.Thread(target=drain)
    draining.start()
    assert not drained.wait(0.3)  # the mean (or a reset) waits for the add

    stripes.locks[0].release()
    assert drained.wait(5.0)
    adding.join(5.0)
    draining.join(5.0)
    assert flat.tolist() == [0, 0, 2, 2, 2, 0, 0, 0, 0, 0]


def test_a_chunk_over_a_stripe_boundary_takes_both_stripes(monkeypatch) -> None:
    monkeypatch.setattr(striped_adds, "STRIPE_ELEMENTS", 4)
    adds, flat, stripes = _new_sum(12)
    assert len(stripes.locks) == 3
    stripes.locks[1].acquire()  # the second stripe is busy: an add over elements 2..5 must wait for it
    adding = threading.Thread(target=adds.add, args=(stripes, flat, 2, torch.ones(4), 1.0))
    adding.start()
    adding.join(0.3)
    assert adding.is_alive() and float(flat.sum()) == 0.0

    stripes.locks[1].release()
    adding.join(5.0)
    assert flat.tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]


def test_each_block_is_checked_just_before_it_is_added(monkeypatch) -> None:
    """One pass over a chunk: a block refused leaves the blocks before it added, and nothing after it."""
    monkeypatch.setattr(striped_adds, "BLOCK_ELEMENTS", 4)
    lock = threading.Lock()
    adds = StripedAdds()
    flat = torch.zeros(12)
    values = torch.ones(12)
    values[9] = float("nan")  # in the third block
    checked, started = [], []

    def check(block: torch.Tensor) -> None:
        checked.append(block.numel())
        if not torch.isfinite(block).all():
            raise ValueError("NaN")

    with lock:
        stripes = adds.begin("w", flat.numel())
    with pytest.raises(ValueError, match="NaN"):
        adds.add(stripes, flat, 0, values, 2.0, check, lambda: started.append(True))
    assert checked == [4, 4, 4] and started == [True]
    assert flat.tolist() == [2.0] * 8 + [0.0] * 4
    with lock:
        adds.drain()  # the refused add is no longer in flight


def test_a_block_refused_first_leaves_the_sum_untouched() -> None:
    aggregator = FoldingModelAggregator()

    def finite(name: str, values: torch.Tensor) -> None:
        if not torch.isfinite(values).all():
            raise ValueError(f"{name!r} holds NaN")

    fold = aggregator.open_result(FLModel(meta={"NUM_STEPS_CURRENT_ROUND": 1}), "site-1", check_tensor=finite)
    fold.check_layout({"w": ((8,), torch.float32)})
    with pytest.raises(ValueError, match="NaN"):
        fold.fold_piece("w", 0, torch.full((8,), float("nan")))
    fold.fail("NaN")
    assert aggregator.tainted() == {}  # nothing was added: no rebuild needed


def test_a_block_whose_stripe_is_busy_waits_while_the_next_ones_are_added(monkeypatch) -> None:
    """Two results in step (chunk k of each at once) take turns block by block instead of queueing."""
    monkeypatch.setattr(striped_adds, "BLOCK_ELEMENTS", 4)
    monkeypatch.setattr(striped_adds, "STRIPE_ELEMENTS", 4)
    adds, flat, stripes = _new_sum(12)
    stripes.locks[0].acquire()  # another result is adding into the first block
    adding = threading.Thread(target=adds.add, args=(stripes, flat, 0, torch.ones(12), 1.0))
    adding.start()
    deadline = time.monotonic() + 5.0
    while float(flat[4:].sum()) < 8.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert flat.tolist() == [0.0] * 4 + [1.0] * 8  # the free blocks went in; the busy one waits
    assert adding.is_alive()

    stripes.locks[0].release()
    adding.join(5.0)
    assert not adding.is_alive() and flat.tolist() == [1.0] * 12


def test_a_new_sum_is_zeroed_stripe_by_stripe_as_adds_reach_it(monkeypatch) -> None:
    monkeypatch.setattr(striped_adds, "BLOCK_ELEMENTS", 4)
    monkeypatch.setattr(striped_adds, "STRIPE_ELEMENTS", 4)
    adds, flat, stripes = _new_sum(12, fill=float("nan"), blank=True)  # NaN: what torch.empty may hold
    adds.add(stripes, flat, 5, torch.ones(2), 3.0)  # lands in the second stripe only
    assert flat[4:8].tolist() == [0.0, 3.0, 3.0, 0.0]
    assert torch.isnan(flat[:4]).all() and torch.isnan(flat[8:]).all()  # not reached: not written
    adds.begin("w", flat.numel())
    adds.add(stripes, flat, 9, torch.ones(3), 2.0)  # the end of the last stripe, not its start
    assert flat[8:].tolist() == [0.0, 2.0, 2.0, 2.0]
    adds.drain()
    adds.settle("w", flat)
    assert flat.tolist() == [0.0] * 5 + [3.0] * 2 + [0.0] * 2 + [2.0] * 3
    adds.begin("w", flat.numel())
    adds.add(stripes, flat, 0, torch.ones(4), 1.0)  # settled: added to, not overwritten
    assert flat[:4].tolist() == [1.0] * 4


def test_blank_sums_give_the_exact_mean_with_results_streamed_and_whole(monkeypatch) -> None:
    """A sum made blank (its memory reused, full of old values) never lets them into the mean:
    streamed results zero each stripe they reach, a whole result or the mean zero the rest."""
    monkeypatch.setattr(striped_adds, "BLOCK_ELEMENTS", 1000)
    monkeypatch.setattr(striped_adds, "STRIPE_ELEMENTS", 1000)
    made = folding.empty_running_sum

    def garbage_sum(shape, dtype):
        current = made(shape, dtype)
        current.total.fill_(float("nan"))
        return current

    monkeypatch.setattr(folding, "empty_running_sum", garbage_sum)
    first, second, third = _tensors(1), _tensors(2), _tensors(3)
    aggregator = FoldingModelAggregator()
    # site-1 streams half of 'w', then site-2's whole result lands, then site-1 streams the rest.
    fold = aggregator.open_result(FLModel(meta={"NUM_STEPS_CURRENT_ROUND": 1}), "site-1")
    fold.check_layout({name: (tuple(t.shape), t.dtype) for name, t in first.items()})
    flat = first["w"].reshape(-1)
    fold.fold_piece("w", 0, flat[:150_000])
    aggregator.accept_model(FLModel(params=second, meta={"NUM_STEPS_CURRENT_ROUND": 2}), "site-2")
    fold.fold_piece("w", 150_000, flat[150_000:])
    fold.complete("w")
    fold.fold("b", first["b"])
    placeholders = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in first.items()}
    aggregator.accept_model(FLModel(params=placeholders, meta={"NUM_STEPS_CURRENT_ROUND": 1}), "site-1")
    _stream_in_chunks(aggregator, "site-3", third, 3, chunk=70_001)

    mean = aggregator.aggregate_model().params
    for name in first:
        expected = (first[name] + 2 * second[name] + 3 * third[name]) / 6
        assert torch.allclose(mean[name], expected, rtol=0, atol=1e-6), name


@pytest.fixture
def reused_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """New sums full of old values (what ``torch.empty`` may return): they must never reach a mean."""
    made = folding.empty_running_sum

    def garbage_sum(shape, dtype):
        current = made(shape, dtype)
        current.total.fill_(1e6)
        return current

    monkeypatch.setattr(folding, "empty_running_sum", garbage_sum)


def test_a_chunk_refused_for_where_it_lands_makes_no_sum(reused_memory) -> None:
    aggregator = FoldingModelAggregator()
    bad = aggregator.open_result(FLModel(meta={"NUM_STEPS_CURRENT_ROUND": 1}), "site-1")
    bad.check_layout({"w": ((4,), torch.float32)})
    with pytest.raises(ValueError, match="past the end"):
        bad.fold_piece("w", 3, torch.ones(4))
    bad.fail("refused")
    _stream_in_chunks(aggregator, "site-2", {"w": torch.full((4,), 2.0)}, 1, chunk=3)

    assert aggregator.tainted() == {}
    assert aggregator.aggregate_model().params["w"].tolist() == [2.0] * 4


def test_a_result_refused_on_its_first_block_leaves_no_value_in_the_mean(reused_memory) -> None:
    def finite(name: str, tensor: torch.Tensor) -> None:
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name!r} holds NaN")

    diff = FLModel(params_type="DIFF", meta={"NUM_STEPS_CURRENT_ROUND": 1})
    aggregator = FoldingModelAggregator()
    fold = aggregator.open_result(diff, "site-1")
    fold.check_layout({"w": ((2,), torch.float32)})
    fold.fold("w", torch.ones(2))
    aggregator.accept_model(FLModel(params_type="DIFF", params={"w": torch.empty(2, device="meta")}), "site-1")
    refused = aggregator.open_result(diff, "site-2", check_tensor=finite)
    refused.check_layout({"b": ((3,), torch.float32), "w": ((2,), torch.float32)})
    with pytest.raises(ValueError, match="NaN"):
        refused.fold_piece("b", 0, torch.full((3,), float("nan")))
    refused.fail("NaN")

    assert aggregator.tainted() == {}
    mean = aggregator.aggregate_model().params
    assert list(mean) == ["w"] and mean["w"].tolist() == [1.0, 1.0]  # site-2's 'b' has no mean: nobody sent one


def test_the_first_add_into_a_blank_stripe_widens_before_it_weighs(reused_memory) -> None:
    """Integers and half floats are weighed in the sum's dtype, as the whole-model aggregator weighs them."""
    values = {"i": torch.tensor([2**30 + 1, 5]), "h": torch.tensor([0.1, 0.7], dtype=torch.float16)}
    meta = {"NUM_STEPS_CURRENT_ROUND": 3}
    folded, whole = FoldingModelAggregator(), WeightedModelAggregator()
    _stream_in_chunks(folded, "site-1", values, 3, chunk=2)
    whole.accept_model(FLModel(params=dict(values), meta=meta), "site-1")

    mean, expected = folded.aggregate_model().params, whole.aggregate_model().params
    assert mean["i"].tolist() == [2**30 + 1, 5]
    for name in values:
        assert torch.equal(mean[name], expected[name]), name
