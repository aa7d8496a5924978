"""WeightedModelAggregator: the FedAvg path's weighted mean of FLModels, FULL or DIFF, never mixed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.aggregators import ModelAggregator, WeightedModelAggregator
from engine.model import FLModel, MetaKey, ParamsType

from .lazy import LazyTensor


def model(value: float, steps: int | None = 1, params_type: ParamsType = ParamsType.FULL, **metrics: Any) -> FLModel:
    meta = {} if steps is None else {MetaKey.NUM_STEPS_CURRENT_ROUND: steps}
    return FLModel(
        params={"w": torch.full((2,), value), "bn.num_batches_tracked": torch.tensor(int(value) * 10)},
        params_type=params_type,
        metrics=metrics or None,
        meta=meta,
        current_round=0,
    )


@pytest.mark.parametrize("params_type", [ParamsType.FULL, ParamsType.DIFF], ids=["full", "diff"])
def test_weighted_mean_keeps_the_params_type(params_type: ParamsType) -> None:
    aggregator = WeightedModelAggregator()
    aggregator.accept_model(model(1.0, steps=1, params_type=params_type, accuracy=0.5), "site-1")
    aggregator.accept_model(model(3.0, steps=3, params_type=params_type, accuracy=0.9), "site-2")

    result = aggregator.aggregate_model()

    assert result.params_type is params_type
    assert result.params["w"].tolist() == pytest.approx([2.5, 2.5])
    assert result.params["bn.num_batches_tracked"].dtype == torch.int64
    assert result.params["bn.num_batches_tracked"].item() == 25
    assert result.metrics == {"accuracy": pytest.approx(0.8)}
    assert result.meta == {"nr_aggregated": 2}


def test_mixing_full_and_diff_is_refused() -> None:
    aggregator = WeightedModelAggregator()
    aggregator.accept_model(model(1.0, params_type=ParamsType.FULL), "site-1")

    with pytest.raises(ValueError, match="result of site-2 has DIFF params but the accepted ones are FULL"):
        aggregator.accept_model(model(1.0, params_type=ParamsType.DIFF), "site-2")

    assert aggregator.aggregate_model().meta == {"nr_aggregated": 1}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"aggregation_weights": {"site-1": 3.0}}, (1.0 * 3 + 5.0 * 1) / 4),
        ({"weigh_by_local_iter": False}, 3.0),
        ({"exclude_vars": "num_batches"}, 3.0),
    ],
    ids=["site-weight", "unweighted", "exclude"],
)
def test_arguments_shape_the_mean(kwargs: dict, expected: float) -> None:
    aggregator = WeightedModelAggregator(**kwargs)
    aggregator.accept_model(model(1.0, steps=7), "site-1")
    aggregator.accept_model(model(5.0, steps=7), "site-2")

    result = aggregator.aggregate_model()

    assert result.params["w"].tolist() == pytest.approx([expected, expected])
    assert ("bn.num_batches_tracked" in result.params) is ("exclude_vars" not in kwargs)


def test_missing_steps_weigh_one_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    aggregator = WeightedModelAggregator()
    aggregator.accept_model(model(1.0, steps=None), "site-1")
    aggregator.accept_model(model(4.0, steps=2), "site-2")

    result = aggregator.aggregate_model()

    assert result.params["w"].tolist() == pytest.approx([3.0, 3.0])
    assert "result has no NUM_STEPS_CURRENT_ROUND meta, weighted 1.0: contributor=site-1" in caplog.text


def test_models_without_metrics_give_no_metrics() -> None:
    aggregator = WeightedModelAggregator()
    aggregator.accept_model(model(1.0), "site-1")

    assert aggregator.aggregate_model().metrics is None


def test_non_numeric_metrics_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    aggregator = WeightedModelAggregator()
    aggregator.accept_model(model(1.0, accuracy=0.5, note="fine"), "site-1")

    result = aggregator.aggregate_model()

    assert result.metrics == {"accuracy": 0.5}
    assert "non-numeric metrics not aggregated: contributor=site-1 names=['note']" in caplog.text


def test_lazy_params_are_resolved_released_and_not_held() -> None:
    lazy = LazyTensor(torch.ones(2))
    aggregator = WeightedModelAggregator()

    aggregator.accept_model(FLModel(params={"w": lazy}), "site-1")

    assert (lazy.resolve_calls, lazy.release_calls, lazy.alive()) == (1, 1, 0)
    assert aggregator.aggregate_model().params["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (FLModel(metrics={"accuracy": 1.0}), "result of site-1 carries no params; nothing to aggregate"),
        (
            FLModel(params={"w": torch.ones(1)}, meta={MetaKey.NUM_STEPS_CURRENT_ROUND: "ten"}),
            "meta NUM_STEPS_CURRENT_ROUND must be a finite number > 0, got 'ten'",
        ),
        (
            FLModel(params={"w": torch.ones(1)}, meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 0}),
            "meta NUM_STEPS_CURRENT_ROUND must be a finite number > 0, got 0",
        ),
        (
            FLModel(params={"w": torch.ones(1)}, meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 2_000_000}),
            "NUM_STEPS_CURRENT_ROUND = 2000000 is above the aggregator's max_local_steps = 1e\\+06; raise",
        ),
    ],
    ids=["no-params", "bad-steps", "zero-steps", "absurd-steps"],
)
def test_unusable_models_are_refused(bad: FLModel, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WeightedModelAggregator().accept_model(bad, "site-1")


def test_a_second_result_of_a_contributor_is_refused() -> None:
    aggregator = WeightedModelAggregator()
    aggregator.accept_model(model(1.0), "site-1")

    with pytest.raises(ValueError, match="site-1 already contributed to round 0"):
        aggregator.accept_model(model(2.0), "site-1")


def test_aggregate_resets_and_reset_stats_forgets() -> None:
    aggregator = WeightedModelAggregator()
    aggregator.accept_model(model(1.0, params_type=ParamsType.DIFF), "site-1")
    aggregator.aggregate_model()
    aggregator.accept_model(model(2.0, params_type=ParamsType.FULL), "site-1")

    aggregator.reset_stats()

    with pytest.raises(RuntimeError, match="nothing to aggregate"):
        aggregator.aggregate_model()


def test_bad_aggregation_weight_is_refused() -> None:
    with pytest.raises(ValueError, match=r"aggregation_weights.site-1: expected a finite number >= 0, got 'x'"):
        WeightedModelAggregator(aggregation_weights={"site-1": "x"})


def test_is_a_model_aggregator() -> None:
    assert isinstance(WeightedModelAggregator(), ModelAggregator)


def test_a_result_above_max_local_steps_is_refused_and_leaves_no_trace() -> None:
    aggregator = WeightedModelAggregator(max_local_steps=10)
    aggregator.accept_model(model(1.0, steps=10), "site-1")

    with pytest.raises(ValueError, match="max_local_steps = 10"):
        aggregator.accept_model(model(9.0, steps=11), "site-2")

    assert aggregator.aggregate_model().params["w"].tolist() == [1.0, 1.0]
