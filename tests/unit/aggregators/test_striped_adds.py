"""Results folded from many threads at once (`StripedAdds`): the same mean, and nothing reads a sum mid-add."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.aggregators import striped_adds
from engine.aggregators.folding import FoldingModelAggregator
from engine.aggregators.striped_adds import StripedAdds
from engine.model import FLModel

SITES = [f"site-{k}" for k in range(1, 9)]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_001, generator=generator), "b": torch.randn(7, generator=generator)}


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
    stripes[0].acquire()  # the add will wait on its stripe: it is in flight meanwhile
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

    stripes[0].release()
    assert drained.wait(5.0)
    adding.join(5.0)
    draining.join(5.0)
    assert flat.tolist() == [0, 0, 2, 2, 2, 0, 0, 0, 0, 0]


def test_a_chunk_over_a_stripe_boundary_takes_both_stripes(monkeypatch) -> None:
    monkeypatch.setattr(striped_adds, "STRIPE_ELEMENTS", 4)
    lock = threading.Lock()
    adds = StripedAdds()
    flat = torch.zeros(12)
    with lock:
        stripes = adds.begin("w", flat.numel())
    assert len(stripes) == 3
    stripes[1].acquire()  # the second stripe is busy: an add over elements 2..5 must wait for it
    adding = threading.Thread(target=adds.add, args=(stripes, flat, 2, torch.ones(4), 1.0))
    adding.start()
    adding.join(0.3)
    assert adding.is_alive() and float(flat.sum()) == 0.0

    stripes[1].release()
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
