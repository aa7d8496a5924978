"""The checks every result goes through (`ResultRules`, `check_finite`): finite values, plausible metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.aggregators import ResultRules, check_metric_ranges
from engine.aggregators.check import check_finite, non_finite_values
from engine.model import DXO, DataKind
from tests.unit.aggregators.test_disk_refs import on_disk


def test_non_finite_values_name_every_value_with_a_nan_or_an_infinity() -> None:
    params = {
        "ok": torch.ones(3),
        "inf_bf16": torch.tensor([1.0, float("inf")], dtype=torch.bfloat16),
        "nan_numpy": np.array([np.nan], dtype=np.float32),
        "nan_number": float("nan"),
        "ints": torch.arange(3),
        "int_number": 3,
        "huge_but_finite": torch.tensor([3e38, -3e38]),
        "minus_inf_f64": torch.tensor([-float("inf")], dtype=torch.float64),
        "half": torch.ones(5, dtype=torch.float16),
        "complex_nan": torch.tensor([complex(1, float("nan"))]),
    }
    assert non_finite_values(params) == ["inf_bf16", "nan_numpy", "nan_number", "minus_inf_f64", "complex_nan"]


def test_a_nan_in_the_last_block_of_a_large_tensor_is_found() -> None:
    value = torch.zeros(3 * 2**20 + 5)  # several blocks, the last one short
    value[-1] = float("nan")
    with pytest.raises(
        ValueError, match=r"^result of site-1 holds NaN or infinite values in 'w'; set allow_non_finite"
    ):
        check_finite({"w": value}, "site-1")


def test_lazy_values_are_checked_block_by_block_from_their_files(tmp_path) -> None:
    bad = torch.ones(2**20)
    bad[123_456] = float("inf")
    refs = on_disk(tmp_path, {"good": torch.ones(10), "bad": bad})
    assert non_finite_values(refs) == ["bad"]


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=300),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
)
def test_check_finite_agrees_with_isfinite_on_any_values(values: list[float], dtype: torch.dtype) -> None:
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    expected = bool(torch.isfinite(tensor).all())
    assert (non_finite_values({"t": tensor}) == []) is expected


def test_metrics_outside_their_range_not_finite_or_oddly_named_are_dropped() -> None:
    rules = ResultRules.from_args(metric_ranges={"accuracy": [0, 1]})
    metrics = {
        "accuracy": 1.5,
        "loss": float("inf"),
        "\x1b[31mred": 0.5,
        "note": "text",
        "flag": True,
        "f1": 0.75,
        "count": 12,
    }
    assert rules.accepted_metrics(metrics, "site-1", 0) == {"f1": 0.75, "count": 12}
    assert rules.accepted_metrics("not a dict", "site-1", 0) == {}
    assert rules.accepted_metrics(None, "site-1", 0) == {}


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=20),
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.text(max_size=5), st.booleans()),
        max_size=10,
    )
)
def test_accepted_metrics_are_always_plain_names_and_finite_numbers_in_range(metrics: dict) -> None:
    rules = ResultRules.from_args(metric_ranges={"a": [0, 1]})
    accepted = rules.accepted_metrics(metrics, "site-1", 0)
    assert set(accepted) <= set(metrics)
    for name, value in accepted.items():
        assert name.isprintable() and len(name) <= 128
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if name == "a":
            assert 0 <= value <= 1


def test_check_dxo_result_refuses_non_finite_weights_and_filters_metrics_in_place() -> None:
    rules = ResultRules()
    shareable = DXO(
        DataKind.WEIGHTS, {"w": torch.ones(2)}, {"metrics": {"acc": 0.5, "bad": float("nan")}}
    ).to_shareable()
    rules.check_dxo_result(shareable, "site-1", 0)
    assert DXO.from_shareable(shareable).meta["metrics"] == {"acc": 0.5}

    poisoned = DXO(DataKind.WEIGHTS, {"w": torch.tensor([float("nan")])}).to_shareable()
    with pytest.raises(ValueError, match="holds NaN or infinite values in 'w'"):
        rules.check_dxo_result(poisoned, "site-1", 0)
    ResultRules(allow_non_finite=True).check_dxo_result(poisoned, "site-1", 0)  # allowed: no error

    metrics_only = DXO(DataKind.METRICS, {"acc": 0.9, "x\ny": 1.0}).to_shareable()
    rules.check_dxo_result(metrics_only, "site-1", 0)
    assert DXO.from_shareable(metrics_only).data == {"acc": 0.9}


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ({"acc": [1, 0]}, r"metric_ranges.acc: expected \[low, high\] with finite low <= high, got \[1, 0\]"),
        ({"acc": [0]}, r"metric_ranges.acc: expected \[low, high\]"),
        ({"acc": [0, float("inf")]}, r"metric_ranges.acc: expected \[low, high\]"),
        ({"a b": [0, 1]}, r"metric_ranges: 'a b' is not a metric name"),
    ],
)
def test_bad_metric_ranges_are_refused_naming_the_entry(ranges: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_metric_ranges(ranges)


def test_allow_non_finite_must_be_a_boolean() -> None:
    with pytest.raises(ValueError, match="allow_non_finite: expected true or false, got 'yes'"):
        ResultRules.from_args(allow_non_finite="yes")  # type: ignore[arg-type]
