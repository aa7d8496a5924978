"""DXOAggregator: which results it accepts, the weighted mean it returns, and releasing lazy values."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from engine.aggregators import DXOAggregator, InTimeAccumulateWeightedAggregator
from engine.model import DXO, DataKind, MetaKey, ReservedHeaderKey, ReturnCode, Shareable, make_reply

from .lazy import LazyTensor


def result(
    value: float = 1.0,
    steps: int | None = 1,
    kind: DataKind = DataKind.WEIGHT_DIFF,
    round_header: int | None = 0,
    metrics: dict | None = None,
) -> Shareable:
    meta = {} if steps is None else {MetaKey.NUM_STEPS_CURRENT_ROUND: steps}
    if metrics is not None:
        meta["metrics"] = metrics
    shareable = DXO(kind, {"w": torch.full((2,), value)}, meta).to_shareable()
    if round_header is not None:
        shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, round_header)
    return shareable


def failed() -> Shareable:
    shareable = result()
    shareable.set_return_code(ReturnCode.EXECUTION_EXCEPTION)
    return shareable


def wrong_shape() -> Shareable:
    return DXO(DataKind.WEIGHT_DIFF, {"w": torch.zeros(3)}, {}).to_shareable()


@pytest.mark.parametrize(
    ("make", "accepted", "logged"),
    [
        (result, True, "result accepted: contributor=site-2 round=1"),
        (lambda: result(round_header=None), True, "result accepted"),
        (failed, False, "reason=return code is EXECUTION_EXCEPTION"),
        (lambda: make_reply(ReturnCode.TASK_ABORTED), False, "reason=return code is TASK_ABORTED"),
        (lambda: result(kind=DataKind.WEIGHTS), False, "reason=data kind is WEIGHTS, expected WEIGHT_DIFF"),
        (lambda: result(round_header=1), False, "reason=it is a result of round 2"),
        (Shareable, False, "reason=the shareable carries no DXO"),
        (lambda: result(steps=-3), False, "meta NUM_STEPS_CURRENT_ROUND must be a finite number > 0, got -3"),
        (lambda: result(steps=0), False, "meta NUM_STEPS_CURRENT_ROUND must be a finite number > 0, got 0"),
        (lambda: result(steps=10**12), False, "is above the aggregator's max_local_steps = 1e+06"),
        (wrong_shape, False, r"site-2: value 'w': shape (3,) differs from the first contribution's (2,)"),
    ],
    ids=[
        "ok",
        "ok-no-round-header",
        "failed",
        "empty-reply",
        "wrong-kind",
        "wrong-round",
        "no-dxo",
        "bad-steps",
        "zero-steps",
        "absurd-steps",
        "wrong-shape",
    ],
)
def test_accept_or_refuse(
    make: Callable[[], Shareable], accepted: bool, logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    aggregator = DXOAggregator()
    aggregator.accept(result(), "site-1", 0)

    with caplog.at_level(logging.INFO, logger="engine.aggregators"):
        got = aggregator.accept(make(), "site-2", 0)

    assert got is accepted
    assert logged in caplog.text


def test_a_second_result_of_a_contributor_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    aggregator = DXOAggregator()
    aggregator.accept(result(1.0), "site-1", 0)

    accepted = aggregator.accept(result(5.0), "site-1", 0)

    assert accepted is False
    assert "contributor=site-1 round=1 reason=a result of this contributor was already accepted" in caplog.text
    assert DXO.from_shareable(aggregator.aggregate(0)).data["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, (1.0 * 1 + 3.0 * 3) / 4),
        ({"aggregation_weights": {"site-2": 0.0}}, 1.0),
        ({"aggregation_weights": {"site-1": 3.0}}, (1.0 * 3 + 3.0 * 3) / 6),
        ({"weigh_by_local_iter": False}, (1.0 + 3.0) / 2),
    ],
    ids=["by-steps", "site-weighted-out", "site-weight", "unweighted"],
)
def test_aggregate_returns_the_weighted_mean(kwargs: dict, expected: float) -> None:
    aggregator = DXOAggregator(**kwargs)
    aggregator.accept(result(1.0, steps=1), "site-1", 0)
    aggregator.accept(result(3.0, steps=3), "site-2", 0)

    dxo = DXO.from_shareable(aggregator.aggregate(0))

    assert dxo.data_kind is DataKind.WEIGHT_DIFF
    assert dxo.data["w"].tolist() == pytest.approx([expected, expected], abs=1e-6)
    assert dxo.meta == {"nr_aggregated": 2, "current_round": 0}


def test_missing_steps_weigh_one_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    aggregator = DXOAggregator()
    aggregator.accept(result(1.0, steps=None), "site-1", 0)
    aggregator.accept(result(4.0, steps=2), "site-2", 0)

    dxo = DXO.from_shareable(aggregator.aggregate(0))

    assert dxo.data["w"].tolist() == pytest.approx([3.0, 3.0])
    assert "result has no NUM_STEPS_CURRENT_ROUND meta, weighted 1.0: contributor=site-1" in caplog.text


def test_metrics_are_aggregated_when_expected() -> None:
    aggregator = DXOAggregator(expected_data_kind="METRICS")
    aggregator.accept(
        DXO(DataKind.METRICS, {"accuracy": 0.5}, {MetaKey.NUM_STEPS_CURRENT_ROUND: 1}).to_shareable(), "site-1", 0
    )
    aggregator.accept(
        DXO(DataKind.METRICS, {"accuracy": 0.9}, {MetaKey.NUM_STEPS_CURRENT_ROUND: 3}).to_shareable(), "site-2", 0
    )

    dxo = DXO.from_shareable(aggregator.aggregate(0))

    assert dxo.data_kind is DataKind.METRICS
    assert dxo.data["accuracy"] == pytest.approx(0.8)


def test_the_metrics_meta_of_weight_results_is_averaged_with_the_same_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    aggregator = DXOAggregator()
    aggregator.accept(result(1.0, steps=1, metrics={"accuracy": 0.5, "note": "text"}), "site-1", 0)
    aggregator.accept(result(3.0, steps=3, metrics={"accuracy": 0.9}), "site-2", 0)
    aggregator.accept(result(5.0, steps=1), "site-3", 0)  # reports no metrics: weighs nothing in them

    dxo = DXO.from_shareable(aggregator.aggregate(0))

    assert dxo.meta["metrics"] == {"accuracy": pytest.approx(0.8)}
    assert "non-numeric metrics not aggregated: contributor=site-1 names=['note']" in caplog.text
    aggregator.accept(result(1.0, round_header=1), "site-1", 1)
    assert "metrics" not in DXO.from_shareable(aggregator.aggregate(1)).meta


def test_exclude_vars_leaves_names_out() -> None:
    aggregator = DXOAggregator(exclude_vars="^private")
    data = {"w": torch.ones(1), "private.w": torch.ones(1)}
    aggregator.accept(DXO(DataKind.WEIGHT_DIFF, data).to_shareable(), "site-1", 0)

    dxo = DXO.from_shareable(aggregator.aggregate(0))

    assert list(dxo.data) == ["w"]


def test_accepted_lazy_values_are_released_once_and_not_held() -> None:
    lazies = {"w": LazyTensor(torch.ones(2)), "b": LazyTensor(torch.ones(1))}
    aggregator = DXOAggregator()

    aggregator.accept(DXO(DataKind.WEIGHT_DIFF, dict(lazies)).to_shareable(), "site-1", 0)

    assert [(lazy.resolve_calls, lazy.release_calls, lazy.alive()) for lazy in lazies.values()] == [(1, 1, 0)] * 2


def test_refused_lazy_values_are_left_to_the_caller() -> None:
    lazy = LazyTensor(torch.ones(2))
    shareable = DXO(DataKind.WEIGHTS, {"w": lazy}).to_shareable()

    accepted = DXOAggregator().accept(shareable, "site-1", 0)

    assert accepted is False
    assert (lazy.resolve_calls, lazy.release_calls) == (0, 0)


def test_a_failing_release_does_not_undo_the_contribution(caplog: pytest.LogCaptureFixture) -> None:
    class BadRelease(LazyTensor):
        def release(self) -> None:
            raise OSError("cannot remove temp file")

    aggregator = DXOAggregator()

    accepted = aggregator.accept(
        DXO(DataKind.WEIGHT_DIFF, {"w": BadRelease(torch.ones(1))}).to_shareable(), "site-1", 0
    )

    assert accepted is True
    assert "release() of a lazy value failed: name=w" in caplog.text
    assert DXO.from_shareable(aggregator.aggregate(0)).data["w"].item() == 1.0


def test_aggregate_resets_for_the_next_round() -> None:
    aggregator = DXOAggregator()
    aggregator.accept(result(1.0), "site-1", 0)
    aggregator.aggregate(0)

    accepted = aggregator.accept(result(7.0, round_header=1), "site-1", 1)

    assert accepted is True
    assert DXO.from_shareable(aggregator.aggregate(1)).data["w"].tolist() == [7.0, 7.0]


def test_reset_forgets_accepted_results() -> None:
    aggregator = DXOAggregator()
    aggregator.accept(result(1.0), "site-1", 0)

    aggregator.reset()

    assert aggregator.accept(result(2.0), "site-1", 0) is True
    assert DXO.from_shareable(aggregator.aggregate(0)).data["w"].tolist() == [2.0, 2.0]


def test_aggregate_with_nothing_accepted_raises() -> None:
    with pytest.raises(RuntimeError, match="nothing to aggregate: no contribution was added"):
        DXOAggregator().aggregate(0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"expected_data_kind": "WEIGHT"},
            r"expected_data_kind: expected one of WEIGHTS, WEIGHT_DIFF, METRICS, got 'WEIGHT'",
        ),
        ({"expected_data_kind": "COLLECTION"}, r"expected_data_kind: expected one of .*, got 'COLLECTION'"),
        ({"aggregation_weights": {"site-1": -1}}, r"aggregation_weights.site-1: expected a finite number >= 0, got -1"),
        ({"exclude_vars": "["}, r"exclude_vars: '\[' is not a valid regular expression"),
    ],
    ids=["unknown-kind", "collection", "negative-weight", "bad-regex"],
)
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DXOAggregator(**kwargs)


def test_flare_name_is_an_alias() -> None:
    assert InTimeAccumulateWeightedAggregator is DXOAggregator


def test_max_local_steps_bounds_what_a_result_may_claim(caplog: pytest.LogCaptureFixture) -> None:
    aggregator = DXOAggregator(max_local_steps=100)
    aggregator.accept(result(1.0, steps=100), "site-1", 0)

    assert aggregator.accept(result(1000.0, steps=101), "site-2", 0) is False

    assert "contributor=site-2 round=1 reason=result of site-2: meta NUM_STEPS_CURRENT_ROUND = 101" in caplog.text
    assert DXO.from_shareable(aggregator.aggregate(0)).data["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("bad", [0, -1, float("inf"), "many"])
def test_max_local_steps_must_be_a_positive_number(bad: object) -> None:
    with pytest.raises(ValueError, match="max_local_steps: expected a finite number > 0"):
        DXOAggregator(max_local_steps=bad)
