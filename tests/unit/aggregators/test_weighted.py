"""WeightedAggregationHelper: exact weighted means per dtype, exclusions, lazy values, refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine.aggregators import WeightedAggregationHelper
from engine.errors import ResultRefused

from .lazy import LazyTensor

# Dyadic values and weights summing to 8: every mean is exact in every dtype, so the result
# must equal the hand computation, cast to the input's dtype.
VALUES = ([0.5, -1.25, 3.0], [1.0, 0.25, -2.0], [2.5, 4.0, 0.75])
INT_VALUES = ([1, 10, 100], [2, 20, 200], [7, 0, 50])
WEIGHTS = (1.0, 3.0, 4.0)


def hand_mean(rows: tuple[list[float], ...], weights: tuple[float, ...]) -> np.ndarray:
    total = sum(w * np.array(r, dtype=np.float64) for r, w in zip(rows, weights, strict=True))
    return total / sum(weights)


def add_all(helper: WeightedAggregationHelper, values: list[Any], weights: tuple[float, ...] = WEIGHTS) -> None:
    for i, (value, weight) in enumerate(zip(values, weights, strict=True)):
        helper.add({"x": value}, weight, f"site-{i + 1}", 0)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.float64],
    ids=["float32", "float16", "bfloat16", "float64"],
)
def test_tensor_mean_is_exact_and_keeps_dtype(dtype: torch.dtype) -> None:
    helper = WeightedAggregationHelper()
    add_all(helper, [torch.tensor(r, dtype=dtype) for r in VALUES])

    result = helper.get_result()["x"]

    assert result.dtype == dtype
    np.testing.assert_allclose(result.double().numpy(), hand_mean(VALUES, WEIGHTS), atol=1e-6, rtol=0)


def test_float32_mean_of_random_values_matches_float64_computation() -> None:
    rows = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    weights = (0.3, 1.7, 2.9)
    helper = WeightedAggregationHelper()
    add_all(helper, rows, weights)

    result = helper.get_result()["x"]

    expected = sum(w * r.double() for r, w in zip(rows, weights, strict=True)) / sum(weights)
    assert result.dtype == torch.float32
    np.testing.assert_allclose(result.double().numpy(), expected.numpy(), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float64, torch.int64],
    ids=["float32", "bfloat16", "float64", "int64"],
)
def test_large_tensors_summed_in_pooled_memory_are_exact(dtype: torch.dtype) -> None:
    rows = INT_VALUES if dtype == torch.int64 else VALUES
    helper = WeightedAggregationHelper()
    add_all(helper, [torch.tensor(r, dtype=dtype).repeat(1 << 18) for r in rows])  # >= 1 MiB each

    result = helper.get_result()["x"]

    expected = np.tile(hand_mean(rows, WEIGHTS), 1 << 18)
    if dtype == torch.int64:
        expected = np.round(expected)
    assert result.dtype == dtype
    np.testing.assert_allclose(result.double().numpy(), expected, atol=1e-6, rtol=0)


def test_the_sum_of_a_round_reuses_the_memory_of_a_dropped_result() -> None:
    helper = WeightedAggregationHelper()
    add_all(helper, [torch.full((1 << 18,), float(i)) for i in range(3)])
    first = helper.get_result()["x"]
    address = first.data_ptr()
    del first

    add_all(helper, [torch.full((1 << 18,), float(i)) for i in range(3)])

    assert helper.get_result()["x"].data_ptr() == address


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_integer_tensor_mean_is_rounded_back_to_its_dtype(dtype: torch.dtype) -> None:
    helper = WeightedAggregationHelper()
    add_all(helper, [torch.tensor(r, dtype=dtype) for r in INT_VALUES])

    result = helper.get_result()["x"]

    assert result.dtype == dtype
    assert result.tolist() == np.round(hand_mean(INT_VALUES, WEIGHTS)).astype(np.int64).tolist()


@pytest.mark.parametrize(
    ("dtype", "rows"),
    [
        (np.float32, VALUES),
        (np.float16, VALUES),
        (np.float64, VALUES),
        (np.int64, INT_VALUES),
    ],
    ids=["float32", "float16", "float64", "int64"],
)
def test_numpy_mean_is_exact_and_keeps_dtype(dtype: type, rows: tuple[list[float], ...]) -> None:
    helper = WeightedAggregationHelper()
    add_all(helper, [np.array(r, dtype=dtype) for r in rows])

    result = helper.get_result()["x"]

    expected = hand_mean(rows, WEIGHTS)
    if np.issubdtype(dtype, np.integer):
        expected = np.round(expected)
    assert isinstance(result, np.ndarray)
    assert result.dtype == dtype
    np.testing.assert_allclose(result.astype(np.float64), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("weigh_metrics", "expected"),
    [(True, (0.5 * 1 + 0.9 * 3) / 4), (False, (0.5 + 0.9) / 2)],
    ids=["weighted", "plain-mean"],
)
def test_numbers_are_averaged_as_floats(weigh_metrics: bool, expected: float) -> None:
    helper = WeightedAggregationHelper(weigh_metrics=weigh_metrics)
    helper.add({"accuracy": 0.5, "w": torch.ones(1)}, 1.0, "site-1", 0)
    helper.add({"accuracy": np.float32(0.9), "w": torch.zeros(1)}, 3.0, "site-2", 0)

    result = helper.get_result()

    assert isinstance(result["accuracy"], float)
    assert result["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert result["w"].item() == pytest.approx(0.25)


def test_excluded_names_are_skipped() -> None:
    helper = WeightedAggregationHelper(exclude_vars=r"running_(mean|var)$")
    data = {"bn.weight": torch.ones(2), "bn.running_mean": torch.ones(2), "bn.running_var": torch.ones(2)}

    helper.add(data, 1.0, "site-1", 0)

    assert list(helper.get_result()) == ["bn.weight"]


def test_bad_exclude_regex_is_refused() -> None:
    with pytest.raises(ValueError, match=r"exclude_vars: '\(' is not a valid regular expression"):
        WeightedAggregationHelper(exclude_vars="(")


def test_inputs_are_not_modified() -> None:
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    helper = WeightedAggregationHelper()
    helper.add({"x": first}, 2.0, "site-1", 0)
    helper.add({"x": second}, 2.0, "site-2", 0)

    helper.get_result()

    assert first.tolist() == [1.0, 2.0] and second.tolist() == [3.0, 4.0]


def test_lazy_values_are_resolved_once_and_not_held() -> None:
    lazies = [LazyTensor(torch.tensor(r)) for r in VALUES]
    helper = WeightedAggregationHelper()

    for i, (lazy, weight) in enumerate(zip(lazies, WEIGHTS, strict=True)):
        helper.add({"x": lazy}, weight, f"site-{i + 1}", 0)
        assert lazy.resolve_calls == 1
        assert lazy.alive() == 0
    result = helper.get_result()["x"]

    np.testing.assert_allclose(result.double().numpy(), hand_mean(VALUES, WEIGHTS), atol=1e-6, rtol=0)
    assert all(lazy.release_calls == 0 for lazy in lazies)  # releasing is the aggregator's call


def test_lazy_values_are_resolved_one_at_a_time() -> None:
    lazies: list[LazyTensor] = []
    alive_at_resolve: list[int] = []

    class Tracking(LazyTensor):
        def resolve(self) -> torch.Tensor:
            alive_at_resolve.append(sum(lazy.alive() for lazy in lazies))
            return super().resolve()

    lazies.extend(Tracking(torch.full((4,), float(i))) for i in range(5))
    helper = WeightedAggregationHelper()

    helper.add({f"t{i}": lazy for i, lazy in enumerate(lazies)}, 1.0, "site-1", 0)

    assert alive_at_resolve == [0] * 5


def test_lazy_value_with_a_wrong_shape_is_refused() -> None:
    helper = WeightedAggregationHelper()
    helper.add({"x": torch.zeros(3)}, 1.0, "site-1", 0)

    with pytest.raises(
        ValueError, match=r"site-2: value 'x': shape \(4,\) differs from the first contribution's \(3,\)"
    ):
        helper.add({"x": LazyTensor(torch.zeros(4))}, 1.0, "site-2", 0)


def test_a_lazy_value_failing_halfway_makes_the_sum_unusable_until_reset() -> None:
    helper = WeightedAggregationHelper()
    helper.add({"a": torch.ones(1), "b": torch.ones(1)}, 1.0, "site-1", 0)

    with pytest.raises(OSError, match="temp file vanished"):
        helper.add({"a": torch.ones(1), "b": LazyTensor(torch.ones(1), fail=True)}, 1.0, "site-2", 0)

    with pytest.raises(RuntimeError, match=r"the running sum is incomplete \(adding 'b' of site-2 failed"):
        helper.get_result()
    helper.reset_stats()
    helper.add({"a": torch.ones(1)}, 1.0, "site-1", 0)
    assert helper.get_result()["a"].item() == 1.0


def test_a_refused_contribution_leaves_the_sum_as_it_was() -> None:
    helper = WeightedAggregationHelper()
    helper.add({"a": torch.ones(2), "b": torch.ones(2)}, 1.0, "site-1", 0)

    with pytest.raises(ValueError, match=r"site-2: value 'b': shape \(3,\) differs"):
        helper.add({"a": torch.zeros(2), "b": torch.zeros(3)}, 1.0, "site-2", 0)

    assert helper.get_len() == 1
    result = helper.get_result()
    assert result["a"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("text", ResultRefused, r"site-1: value 'x': cannot aggregate a value of type str"),
        (np.zeros(2), ResultRefused, r"site-1: value 'x': expected a tensor, got a ndarray"),
    ],
    ids=["unsupported-type", "kind-changes"],
)
def test_values_that_do_not_fit_are_refused(value: Any, error: type[Exception], match: str) -> None:
    helper = WeightedAggregationHelper()
    helper.add({"x": torch.zeros(2)}, 1.0, "site-0", 0)

    with pytest.raises(error, match=match):
        helper.add({"x": value}, 1.0, "site-1", 0)


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf"), "2"], ids=["negative", "nan", "inf", "string"])
def test_invalid_weights_are_refused(weight: Any) -> None:
    with pytest.raises(ValueError, match=r"weight of site-1: expected a finite number >= 0"):
        WeightedAggregationHelper().add({"x": torch.zeros(1)}, weight, "site-1", 0)


def test_a_second_contribution_to_the_same_round_is_refused() -> None:
    helper = WeightedAggregationHelper()
    helper.add({"x": torch.ones(1)}, 1.0, "site-1", 3)

    with pytest.raises(ValueError, match=r"site-1 already contributed to round 3; a second contribution is refused"):
        helper.add({"x": torch.ones(1)}, 1.0, "site-1", 3)
    helper.add({"x": torch.ones(1)}, 1.0, "site-1", 4)

    assert helper.get_len() == 2


def test_history_lists_each_contribution() -> None:
    helper = WeightedAggregationHelper()
    helper.add({"x": torch.ones(1)}, 2.0, "site-1", 0)
    helper.add({"x": torch.ones(1)}, 5.0, "site-2", 0)

    history = helper.get_history()

    assert history == [
        {"contributor_name": "site-1", "round": 0, "weight": 2.0},
        {"contributor_name": "site-2", "round": 0, "weight": 5.0},
    ]


def test_nothing_added_has_no_result() -> None:
    with pytest.raises(RuntimeError, match="nothing to aggregate: no contribution was added"):
        WeightedAggregationHelper().get_result()


def test_zero_total_weight_has_no_result() -> None:
    helper = WeightedAggregationHelper()
    helper.add({"x": torch.ones(1)}, 0.0, "site-1", 0)

    with pytest.raises(ValueError, match=r"total weight is 0 for 1 value\(s\), e.g. 'x'"):
        helper.get_result()


def test_get_result_resets_the_helper() -> None:
    helper = WeightedAggregationHelper()
    helper.add({"x": torch.ones(1)}, 1.0, "site-1", 0)

    helper.get_result()

    assert helper.get_len() == 0 and helper.get_history() == []
    helper.add({"x": torch.zeros(1)}, 1.0, "site-1", 0)
    assert helper.get_result()["x"].item() == 0.0


def test_reset_stats_forgets_everything() -> None:
    helper = WeightedAggregationHelper()
    helper.add({"x": torch.ones(1)}, 1.0, "site-1", 0)

    helper.reset_stats()

    assert helper.get_len() == 0
    with pytest.raises(RuntimeError, match="nothing to aggregate"):
        helper.get_result()
