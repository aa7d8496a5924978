"""`FoldingModelAggregator`: the weighted mean folded tensor by tensor; refusals leave no trace."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.aggregators import WeightedModelAggregator, check_params_match, folding
from engine.aggregators.folding import FoldingModelAggregator
from engine.model import FLModel, ParamsType

SHAPES = {"w": (64, 3), "b": (3,), "steps": ()}


def _result(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 3, generator=generator),
        "b": torch.randn(3, generator=generator, dtype=torch.float64),
        "steps": torch.tensor(seed * 7, dtype=torch.int64),
    }


def _layout(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def _header(steps: float, metrics: dict | None = None) -> FLModel:
    return FLModel(meta={"NUM_STEPS_CURRENT_ROUND": steps}, metrics=metrics)


def _placeholders(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in tensors.items()}


def _stream(aggregator: FoldingModelAggregator, site: str, tensors: dict, steps: float, **kw) -> None:
    fold = aggregator.open_result(_header(steps), site, **kw)
    fold.check_layout(_layout(tensors))
    for name, tensor in tensors.items():
        fold.fold(name, tensor.clone())
    aggregator.accept_model(FLModel(params=_placeholders(tensors), metrics={"acc": steps / 10}), site)


def _expected(results: dict[str, dict], weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """The weighted mean computed apart, in float64 (then rounded to each dtype as the aggregator does)."""
    total = sum(weights.values())
    out = {}
    for name, first in next(iter(results.values())).items():
        mean = sum(weights[s] * r[name].double() for s, r in results.items()) / total
        out[name] = mean.round().to(first.dtype) if not first.dtype.is_floating_point else mean
    return out


def test_folded_results_give_the_weighted_mean_computed_apart() -> None:
    results = {"site-1": _result(1), "site-2": _result(2), "site-3": _result(3)}
    weights = {"site-1": 2.0 * 0.5, "site-2": 5.0, "site-3": 1.0}
    aggregator = FoldingModelAggregator(aggregation_weights={"site-1": 0.5})
    _stream(aggregator, "site-1", results["site-1"], 2)
    _stream(aggregator, "site-2", results["site-2"], 5)
    aggregator.accept_model(FLModel(params=results["site-3"], meta={"NUM_STEPS_CURRENT_ROUND": 1}), "site-3")  # whole

    model = aggregator.aggregate_model()

    expected = _expected(results, weights)
    assert model.meta == {"nr_aggregated": 3} and model.params_type is ParamsType.FULL
    for name, value in model.params.items():
        assert value.dtype == results["site-1"][name].dtype
        assert torch.allclose(value.double(), expected[name].double(), rtol=0, atol=1e-6), name
    assert model.metrics["acc"] == pytest.approx((0.2 * 1.0 + 0.5 * 5.0) / 6.0)  # site-3 sent no metrics


def test_the_same_mean_as_the_weighted_model_aggregator_bit_for_bit() -> None:
    results = {f"site-{k}": _result(k) for k in (1, 2, 3)}
    folding, whole = FoldingModelAggregator(), WeightedModelAggregator()
    for k, (site, tensors) in enumerate(results.items(), start=1):
        _stream(folding, site, tensors, k)
        whole.accept_model(
            FLModel(params={n: t.clone() for n, t in tensors.items()}, meta={"NUM_STEPS_CURRENT_ROUND": k}), site
        )
    a, b = folding.aggregate_model().params, whole.aggregate_model().params
    assert all(torch.equal(a[name], b[name]) for name in b)


def test_tensors_of_several_results_interleaved_sum_exactly() -> None:
    results = {f"site-{k}": _result(k) for k in (1, 2, 3)}
    aggregator = FoldingModelAggregator()
    folds = {}
    for k, (site, tensors) in enumerate(results.items(), start=1):
        folds[site] = aggregator.open_result(_header(k), site)
        folds[site].check_layout(_layout(tensors))
    for name in ("b", "w", "steps"):  # tensor by tensor, every result at once
        for site, fold in folds.items():
            fold.fold(name, results[site][name])
    for site, tensors in results.items():
        aggregator.accept_model(FLModel(params=_placeholders(tensors)), site)

    expected = _expected(results, {"site-1": 1.0, "site-2": 2.0, "site-3": 3.0})
    mean = aggregator.aggregate_model().params
    assert all(torch.allclose(mean[n].double(), expected[n].double(), rtol=0, atol=1e-6) for n in mean)


@pytest.mark.parametrize(
    "lie, match",
    [
        ({"NUM_STEPS_CURRENT_ROUND": 10**9}, "above the aggregator's max_local_steps"),
        ({"NUM_STEPS_CURRENT_ROUND": float("nan")}, "finite number > 0"),
        ({"NUM_STEPS_CURRENT_ROUND": -1}, "finite number > 0"),
    ],
)
def test_a_lying_header_is_refused_before_anything_is_folded(lie: dict, match: str) -> None:
    honest = {"site-1": _result(1), "site-2": _result(2)}
    aggregator, reference = FoldingModelAggregator(), FoldingModelAggregator()
    _stream(aggregator, "site-1", honest["site-1"], 1)
    with pytest.raises(ValueError, match=match):
        aggregator.open_result(FLModel(meta=lie), "site-3")
    _stream(aggregator, "site-2", honest["site-2"], 2)
    for site, k in (("site-1", 1), ("site-2", 2)):
        _stream(reference, site, honest[site], k)

    assert aggregator.tainted() == {}
    a, b = aggregator.aggregate_model().params, reference.aggregate_model().params
    assert all(torch.equal(a[n], b[n]) for n in b)  # as if it never arrived: bit for bit


def test_a_layout_unlike_the_model_is_refused_before_the_first_tensor() -> None:
    model = _result(0)
    reference = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in model.items()}
    aggregator = FoldingModelAggregator()
    _stream(aggregator, "site-1", _result(1), 1)

    def check(params: dict) -> None:
        check_params_match(reference, params, "site-2")

    fold = aggregator.open_result(_header(3), "site-2", check_layout=check)
    bad = dict(_result(2), w=torch.zeros(64, 4))
    with pytest.raises(ValueError, match="shape"):
        fold.check_layout(_layout(bad))
    fold.fail("refused")
    assert aggregator.tainted() == {}
    assert torch.equal(aggregator.aggregate_model().params["w"], _result(1)["w"])


def test_a_result_failing_midway_taints_the_sum_and_no_mean_is_made_from_it() -> None:
    aggregator = FoldingModelAggregator()
    _stream(aggregator, "site-1", _result(1), 1)
    tensors = _result(2)
    fold = aggregator.open_result(_header(4), "site-2")
    fold.check_layout(_layout(tensors))
    fold.fold("w", tensors["w"])
    fold.fail("site-2 died mid-upload")

    assert aggregator.tainted() == {"site-2": "site-2 died mid-upload"}
    with pytest.raises(RuntimeError, match="site-2"):
        aggregator.aggregate_model()
    aggregator.reset_stats()  # the round runs again: a clean sum
    _stream(aggregator, "site-1", _result(1), 1)
    assert torch.equal(aggregator.aggregate_model().params["w"], _result(1)["w"])


def test_a_non_finite_tensor_is_refused_before_it_is_folded() -> None:
    def finite(name: str, tensor: torch.Tensor) -> None:
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name!r} holds NaN")

    aggregator = FoldingModelAggregator()
    tensors = _result(1)
    fold = aggregator.open_result(_header(1), "site-1", check_tensor=finite)
    fold.check_layout(_layout(tensors))
    with pytest.raises(ValueError, match="NaN"):
        fold.fold("w", torch.full((64, 3), float("nan")))
    fold.fail("NaN")
    assert aggregator.tainted() == {}  # nothing of it was folded


def test_closing_fails_open_results_and_refuses_new_ones() -> None:
    aggregator = FoldingModelAggregator()
    tensors = _result(1)
    fold = aggregator.open_result(_header(1), "site-1")
    fold.check_layout(_layout(tensors))
    fold.fold("b", tensors["b"])
    aggregator.close()
    assert "site-1" in aggregator.tainted()
    with pytest.raises(ValueError, match="closed"):
        aggregator.open_result(_header(1), "site-2")
    with pytest.raises(ValueError, match="closed"):
        fold.fold("w", tensors["w"])


def test_a_result_failed_by_the_round_closing_while_its_chunk_is_checked_adds_nothing_untainted() -> None:
    """The round closes (another thread) while a straggler's first chunk is being checked: that
    chunk must not land in a sum that is not tainted, or the mean holds values nobody weighed."""
    checking, go_on = threading.Event(), threading.Event()

    def slow_check(name: str, tensor: torch.Tensor) -> None:
        checking.set()
        assert go_on.wait(10)

    aggregator = FoldingModelAggregator()
    _stream(aggregator, "site-1", _result(1), 1)
    tensors = _result(2)
    fold = aggregator.open_result(_header(1), "site-2", check_tensor=slow_check)
    fold.check_layout(_layout(tensors))
    raised: list[BaseException] = []

    def pull() -> None:
        try:
            fold.fold("w", tensors["w"])
        except BaseException as e:  # noqa: BLE001 - looked at below
            raised.append(e)

    puller = threading.Thread(target=pull)
    puller.start()
    assert checking.wait(10)
    aggregator.close()  # the round's loop: site-2 is still open
    go_on.set()
    puller.join(10)

    assert aggregator.tainted() == {}  # nothing of site-2 was added: no rebuild is needed
    assert len(raised) == 1 and "closed" in str(raised[0])
    assert torch.equal(aggregator.aggregate_model().params["w"], _result(1)["w"])


def test_a_second_result_and_another_params_type_are_refused() -> None:
    aggregator = FoldingModelAggregator()
    _stream(aggregator, "site-1", _result(1), 1)
    with pytest.raises(ValueError, match="already contributed"):
        aggregator.open_result(_header(1), "site-1")
    diff = aggregator.open_result(FLModel(params_type=ParamsType.DIFF, meta={"NUM_STEPS_CURRENT_ROUND": 1}), "site-2")
    with pytest.raises(ValueError, match="one type"):  # refused with its layout, before any tensor
        diff.check_layout(_layout(_result(2)))
    diff.fail("refused")
    assert aggregator.tainted() == {}


def _held_stream(
    aggregator: FoldingModelAggregator,
    site: str,
    tensors: dict,
    steps: float,
    log: list,
    again: dict | None = None,
    pull_again=None,
) -> None:
    """`_stream` of a result its sender still holds: ``refold`` pulls it again (``again``: other values then)."""

    def refold(fold) -> None:
        log.append(("refold", site))
        pulled = tensors if again is None else again
        fold.check_layout(_layout(pulled))
        for name, tensor in pulled.items():
            fold.fold(name, tensor.clone())

    fold = aggregator.open_result(_header(steps), site, check_tensor=_finite)
    fold.refold = pull_again or refold
    fold.release = lambda: log.append(("release", site))
    fold.check_layout(_layout(tensors))
    for name, tensor in tensors.items():
        fold.fold(name, tensor.clone())
    aggregator.accept_model(FLModel(params=_placeholders(tensors), metrics={"acc": steps / 10}), site)


def _finite(name: str, tensor: torch.Tensor) -> None:
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{name!r} holds NaN")


def test_a_tainted_sum_is_rebuilt_from_the_others_and_equals_their_mean() -> None:
    log: list = []
    aggregator = FoldingModelAggregator()
    _held_stream(aggregator, "site-1", _result(1), 2, log)
    dying = aggregator.open_result(_header(9), "site-2")  # folds half of itself, then its sender dies
    dying.check_layout(_layout(_result(2)))
    dying.fold("w", _result(2)["w"])
    _held_stream(aggregator, "site-3", _result(3), 5, log)
    dying.fail("site-2 died mid-upload")
    aggregator.close()

    assert aggregator.rebuild() == {}
    assert aggregator.tainted() == {}
    assert sorted(entry for entry in log if entry[0] == "refold") == [("refold", "site-1"), ("refold", "site-3")]
    model = aggregator.aggregate_model()

    clean = FoldingModelAggregator()  # the same round without site-2
    _stream(clean, "site-1", _result(1), 2)
    _stream(clean, "site-3", _result(3), 5)
    expected = clean.aggregate_model()
    for name in SHAPES:  # the pulls run at once: the sum's order, and so the last bit, may differ
        assert torch.allclose(model.params[name].double(), expected.params[name].double(), rtol=0, atol=1e-6), name
    assert model.metrics == expected.metrics and model.meta["nr_aggregated"] == 2
    assert sorted(entry for entry in log if entry[0] == "release") == [("release", "site-1"), ("release", "site-3")]


def test_a_result_that_cannot_be_pulled_again_is_left_out_and_released() -> None:
    log: list = []
    aggregator = FoldingModelAggregator()
    _held_stream(aggregator, "site-1", _result(1), 2, log)
    aggregator.accept_model(FLModel(params=_result(3), meta={"NUM_STEPS_CURRENT_ROUND": 1}), "site-3")  # whole
    gone = aggregator.open_result(_header(3), "site-4")  # committed, but its sender will be gone
    gone.refold = lambda fold: (_ for _ in ()).throw(RuntimeError("site-4 is unreachable"))
    gone.release = lambda: log.append(("release", "site-4"))
    gone.check_layout(_layout(_result(4)))
    for name, tensor in _result(4).items():
        gone.fold(name, tensor)
    aggregator.accept_model(FLModel(params=_placeholders(_result(4))), "site-4")
    dying = aggregator.open_result(_header(1), "site-2")
    dying.check_layout(_layout(_result(2)))
    dying.fold("b", _result(2)["b"])
    aggregator.close()  # site-2 is still open: it fails and taints the sum

    left_out = aggregator.rebuild()

    assert sorted(left_out) == ["site-3", "site-4"]
    assert "arrived whole" in left_out["site-3"] and "unreachable" in left_out["site-4"]
    assert ("release", "site-4") in log
    model = aggregator.aggregate_model()
    assert model.meta["nr_aggregated"] == 1
    for name, tensor in _result(1).items():
        assert torch.equal(model.params[name], tensor), name  # site-1 alone


def test_a_rebuild_refuses_a_result_whose_second_pull_breaks_the_rules() -> None:
    log: list = []
    aggregator = FoldingModelAggregator()
    _held_stream(aggregator, "site-1", _result(1), 1, log)
    changed = {**_result(3), "w": torch.full((64, 3), float("nan"))}  # the sender changed its values meanwhile
    _held_stream(aggregator, "site-3", _result(3), 1, log, again=changed)
    dying = aggregator.open_result(_header(1), "site-2")
    dying.check_layout(_layout(_result(2)))
    dying.fold("w", _result(2)["w"])
    dying.fail("died")

    left_out = aggregator.rebuild()

    assert list(left_out) == ["site-3"] and "NaN" in left_out["site-3"]
    assert log.count(("refold", "site-3")) == 1 and ("release", "site-3") in log
    assert torch.equal(aggregator.aggregate_model().params["w"], _result(1)["w"])


@pytest.mark.parametrize("stopping", [False, True], ids=["too-slow", "job-stopping"])
def test_a_result_that_does_not_come_again_in_time_is_left_out(monkeypatch: pytest.MonkeyPatch, stopping: bool) -> None:
    monkeypatch.setattr(folding, "MIN_REBUILD_S", 0.5 if not stopping else 60.0)
    log: list = []
    aggregator = FoldingModelAggregator()
    answer = threading.Event()

    def stalling(fold) -> None:  # an honest first pull, then a sender that takes its time
        fold.check_layout(_layout(_result(3)))
        fold.fold("w", _result(3)["w"])
        answer.wait(30)
        fold.fold("b", _result(3)["b"])  # too late: refused, the rebuilt sum never sees it

    _held_stream(aggregator, "site-1", _result(1), 1, log)
    _held_stream(aggregator, "site-3", _result(3), 1, log, pull_again=stalling)
    dying = aggregator.open_result(_header(1), "site-2")
    dying.check_layout(_layout(_result(2)))
    dying.fold("w", _result(2)["w"])
    dying.fail("died")
    stop = threading.Event()
    if stopping:
        threading.Timer(0.3, stop.set).start()

    started = time.monotonic()
    left_out = aggregator.rebuild(stop)
    answer.set()

    assert time.monotonic() - started < 10
    assert aggregator.tainted() == {}
    if stopping:  # no mean will be made: everything is left out, nothing waited for
        assert "the job is stopping" in left_out["site-3"] and ("release", "site-1") in log
        return
    assert list(left_out) == ["site-3"] and "not in again within 0.5 s" in left_out["site-3"]
    model = aggregator.aggregate_model()
    assert model.meta["nr_aggregated"] == 1 and torch.equal(model.params["w"], _result(1)["w"])


def test_a_result_committed_again_as_its_time_runs_out_counts_and_is_not_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its pull thread has committed it but not yet ended when the rebuild's time is up: it is in
    the mean, so it is neither reported left out nor released before the mean exists."""
    monkeypatch.setattr(folding, "MIN_REBUILD_S", 0.2)
    log: list = []

    class SlowToEnd(FoldingModelAggregator):
        def _commit(self, fold, names):
            committed = super()._commit(fold, names)
            if fold.rebuilding:
                time.sleep(1.0)  # the thread lives on past the 0.2 s allowed, its result committed
            return committed

    aggregator = SlowToEnd()
    _held_stream(aggregator, "site-1", _result(1), 1, log)
    dying = aggregator.open_result(_header(1), "site-2")
    dying.check_layout(_layout(_result(2)))
    dying.fold("w", _result(2)["w"])
    aggregator.close()

    left_out = aggregator.rebuild()

    assert left_out == {} and ("release", "site-1") not in log
    model = aggregator.aggregate_model()
    assert model.meta["nr_aggregated"] == 1 and torch.equal(model.params["w"], _result(1)["w"])
    assert ("release", "site-1") in log  # once the mean exists
