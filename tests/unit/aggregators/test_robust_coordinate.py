"""CoordinateMedianAggregator and TrimmedMeanAggregator against numpy's median and a sort-and-slice mean."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.aggregators import CoordinateMedianAggregator, TrimmedMeanAggregator
from engine.model import ParamsType

from .test_robust_kept import TINY_BLOCK_BYTES, as_kind, result

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
KINDS = ["tensor", "numpy", "lazy", "lazy-numpy"]
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def client_params(count: int, dtype: torch.dtype, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` results: two float tensors (one spans several blocks) and an integer counter."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "w": torch.randn(5, 7, generator=generator).to(dtype),
            "b": torch.randn(4, generator=generator).to(dtype),
            "bn.num_batches_tracked": torch.randint(0, 100, (), generator=generator),
        }
        for _ in range(count)
    ]


def stacked(params: list[dict[str, torch.Tensor]], name: str) -> np.ndarray:
    return np.stack([p[name].double().numpy() for p in params])


def sort_and_slice_mean(values: np.ndarray, trim_fraction: float) -> np.ndarray:
    trimmed = math.floor(trim_fraction * values.shape[0])
    ordered = np.sort(values, axis=0)
    return ordered[trimmed : values.shape[0] - trimmed].mean(axis=0)


def aggregate(aggregator, params: list[dict], kind: str, root: Path, params_type=ParamsType.FULL):
    for i, values in enumerate(params):
        aggregator.accept_model(result(as_kind(values, kind, root), params_type), f"site-{i}")
    return aggregator.aggregate_model()


def assert_matches(value, expected: np.ndarray, dtype: torch.dtype, kind: str) -> None:
    assert isinstance(value, np.ndarray) is (kind in ("numpy", "lazy-numpy"))
    tensor = torch.as_tensor(value)
    assert tensor.dtype == dtype and tuple(tensor.shape) == expected.shape
    if dtype.is_floating_point:
        np.testing.assert_allclose(tensor.double().numpy(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    else:
        assert tensor.numpy().tolist() == np.round(expected).astype(np.int64).tolist()


def combinations():
    for kind in KINDS:
        for name, dtype in DTYPES.items():
            if dtype is torch.bfloat16 and "numpy" in kind:
                continue  # numpy has no bfloat16
            yield pytest.param(kind, dtype, id=f"{kind}-{name}")


@pytest.mark.parametrize("count", [4, 5], ids=["even", "odd"])
@pytest.mark.parametrize(("kind", "dtype"), list(combinations()))
def test_the_median_is_numpys_median_per_coordinate(kind: str, dtype: torch.dtype, count: int, tmp_path: Path) -> None:
    params = client_params(count, dtype)

    aggregate_ = aggregate(CoordinateMedianAggregator(block_bytes=TINY_BLOCK_BYTES), params, kind, tmp_path)

    for name in params[0]:
        assert_matches(aggregate_.params[name], np.median(stacked(params, name), axis=0), params[0][name].dtype, kind)


@pytest.mark.parametrize(
    ("count", "trim_fraction"), [(5, 0.2), (6, 0.2), (7, 0.3), (10, 0.45)], ids=["5-0.2", "6-0.2", "7-0.3", "10-0.45"]
)
@pytest.mark.parametrize(("kind", "dtype"), list(combinations()))
def test_the_trimmed_mean_is_the_mean_of_the_sorted_middle(
    kind: str, dtype: torch.dtype, count: int, trim_fraction: float, tmp_path: Path
) -> None:
    params = client_params(count, dtype, seed=count)
    aggregator = TrimmedMeanAggregator(trim_fraction=trim_fraction, block_bytes=TINY_BLOCK_BYTES)

    aggregate_ = aggregate(aggregator, params, kind, tmp_path)

    assert aggregate_.meta == {"nr_aggregated": count, "trimmed": math.floor(trim_fraction * count)}
    for name in params[0]:
        expected = sort_and_slice_mean(stacked(params, name), trim_fraction)
        assert_matches(aggregate_.params[name], expected, params[0][name].dtype, kind)


@pytest.mark.parametrize("params_type", [ParamsType.FULL, ParamsType.DIFF], ids=["full", "diff"])
@pytest.mark.parametrize(
    "make", [CoordinateMedianAggregator, lambda: TrimmedMeanAggregator(trim_fraction=0.25)], ids=["median", "trimmed"]
)
def test_the_aggregate_has_the_results_params_type(make, params_type: ParamsType, tmp_path: Path) -> None:
    params = client_params(4, torch.float32)

    aggregate_ = aggregate(make(), params, "tensor", tmp_path, params_type)

    assert aggregate_.params_type is params_type
    # With 4 results, trimming 1 at each end leaves the two middle values: the median too.
    np.testing.assert_allclose(aggregate_.params["w"].numpy(), np.median(stacked(params, "w"), axis=0), rtol=1e-6)


ATTACKS = {
    "scaled": lambda x: x * 1e6,
    "sign-flip": lambda x: -x,
    "huge-constant": lambda x: torch.full_like(x, 1e30),
    "nan": lambda x: torch.full_like(x, float("nan")),
    "minus-inf": lambda x: torch.full_like(x, float("-inf")),
}


@pytest.mark.parametrize("attack", ATTACKS.values(), ids=ATTACKS.keys())
@pytest.mark.parametrize(
    "make",
    [CoordinateMedianAggregator, lambda: TrimmedMeanAggregator(trim_fraction=0.2)],
    ids=["median", "trimmed"],
)
def test_one_wild_result_stays_outside_the_aggregate(make, attack, tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    honest = [{"w": 1.0 + torch.rand(64, generator=generator)} for _ in range(4)]
    attacker = {"w": attack(honest[0]["w"])}
    aggregator = make()
    for i, params in enumerate([*honest, attacker]):
        aggregator.accept_model(result(as_kind(params, "lazy", tmp_path)), f"site-{i}")

    combined = aggregator.aggregate_model().params["w"]

    lowest, highest = torch.stack([p["w"] for p in honest]).aminmax(dim=0)
    assert bool(((combined >= lowest) & (combined <= highest)).all())


def test_metrics_are_combined_by_the_same_rule() -> None:
    accuracies = [0.1, 0.5, 0.6, 0.7, 99.0]
    median, trimmed = CoordinateMedianAggregator(), TrimmedMeanAggregator(trim_fraction=0.2)
    for i, accuracy in enumerate(accuracies):
        metrics = {"accuracy": accuracy, **({"loss": float(i)} if i < 2 else {})}
        for aggregator in (median, trimmed):
            aggregator.accept_model(result({"w": torch.zeros(1)}, **metrics), f"site-{i}")

    assert median.aggregate_model().metrics == {"accuracy": 0.6, "loss": 0.5}
    assert trimmed.aggregate_model().metrics == pytest.approx({"accuracy": 0.6, "loss": 0.5})


def test_a_trim_fraction_too_small_for_the_round_trims_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    aggregator = TrimmedMeanAggregator(trim_fraction=0.2)
    for i in range(4):
        aggregator.accept_model(result({"w": torch.full((2,), float(i))}), f"site-{i}")

    with caplog.at_level(logging.WARNING):
        aggregate_ = aggregator.aggregate_model()

    assert aggregate_.params["w"].tolist() == [1.5, 1.5]
    assert "trimmed mean trims nothing: nr_aggregated=4 trim_fraction=0.2 (needs at least 5 results" in caplog.text


def test_one_result_is_its_own_median(tmp_path: Path) -> None:
    params = client_params(1, torch.float16)

    aggregate_ = aggregate(CoordinateMedianAggregator(), params, "lazy", tmp_path)

    assert torch.equal(aggregate_.params["w"], params[0]["w"])


@settings(max_examples=60, deadline=None)
@given(
    data=st.integers(1, 9).flatmap(
        lambda count: hnp.arrays(
            np.float32,
            st.tuples(st.just(count), st.integers(1, 40)),
            elements=st.floats(-1e6, 1e6, width=32),
        )
    ),
    trim_fraction=st.floats(0.0, 0.49),
    block_bytes=st.integers(4, 64),
)
def test_median_and_trimmed_mean_of_random_arrays_are_numpys(
    data: np.ndarray, trim_fraction: float, block_bytes: int
) -> None:
    median = CoordinateMedianAggregator(block_bytes=block_bytes)
    trimmed = TrimmedMeanAggregator(trim_fraction=trim_fraction, block_bytes=block_bytes)
    for i, row in enumerate(data):
        for aggregator in (median, trimmed):
            aggregator.accept_model(result({"x": torch.from_numpy(row.copy())}), f"site-{i}")

    np.testing.assert_allclose(median.aggregate_model().params["x"].numpy(), np.median(data, axis=0), rtol=1e-6)
    expected = sort_and_slice_mean(data.astype(np.float64), trim_fraction)
    # Summed in float32: values of opposite signs cancel, leaving an error of a few ulps of the largest.
    atol = 1e-3 + 8 * float(np.finfo(np.float32).eps) * float(np.abs(data).max())
    np.testing.assert_allclose(trimmed.aggregate_model().params["x"].numpy(), expected, rtol=1e-5, atol=atol)
