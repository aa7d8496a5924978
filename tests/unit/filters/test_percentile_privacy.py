"""PercentilePrivacy and abs_percentile: checked against numpy's percentile over the joined update."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine.filters import PercentilePrivacy
from engine.filters import updates as updates_module
from engine.filters.selection import abs_percentile
from engine.model import DXO, DataKind, FLModel, ParamsType, Shareable, shareable_from_model


def random_update(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(37, 11), (5,), (), (3, 4, 2), (200,)]
    return {
        f"t{i}": (torch.randn(shape, generator=generator) * 10.0 ** (i - 3)).to(dtype) for i, shape in enumerate(shapes)
    }


def joined_abs(params: dict[str, torch.Tensor]) -> np.ndarray:
    return np.abs(np.concatenate([t.numpy().ravel() for t in params.values()]))


def diff_shareable(params: dict[str, Any]) -> Shareable:
    return shareable_from_model(FLModel(params=params, params_type=ParamsType.DIFF))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("percentile", [0, 10, 33.3, 50, 87.25, 99.9, 100])
def test_abs_percentile_equals_numpy_over_the_joined_update(dtype: torch.dtype, percentile: float) -> None:
    params = random_update(3, dtype)

    got = abs_percentile(params, percentile)

    assert got == pytest.approx(float(np.percentile(joined_abs(params), percentile)), rel=1e-6, abs=0)


def test_abs_percentile_is_exact_across_blocks_and_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(updates_module, "BLOCK_ELEMENTS", 64)  # several blocks per tensor
    params = random_update(4)
    params["t1"][:] = params["t0"][0, 0]  # ties across tensors
    values = joined_abs(params)
    n = values.size

    for k in [0, 1, n // 3, n // 2, n - 2, n - 1]:
        percentile = 100 * k / (n - 1)  # an order statistic itself: no interpolation
        assert abs_percentile(params, percentile) == np.sort(values)[k]


def test_abs_percentile_mixes_dtypes_as_numpy_widens() -> None:
    params = {"a": torch.randn(300).half(), "b": torch.randn(200), "c": torch.randn(50).to(torch.bfloat16)}
    joined = np.concatenate([t.float().numpy() for t in params.values()])

    assert abs_percentile(params, 42.0) == pytest.approx(float(np.percentile(np.abs(joined), 42.0)), rel=1e-6)


@pytest.mark.parametrize(("percentile", "gamma"), [(10, 0.01), (50, 0.05), (0, 1.0), (95, 0.001)])
def test_filter_keeps_values_at_or_above_the_cutoff_clipped(percentile: float, gamma: float) -> None:
    params = random_update(5)
    original = {name: t.numpy().copy() for name, t in params.items()}
    cutoff = np.percentile(joined_abs(params), percentile)
    shareable = diff_shareable(params)

    result = PercentilePrivacy(percentile=percentile, gamma=gamma).process(shareable, "site-1")

    assert result is shareable
    for name, tensor in result["FLModel"].params.items():
        expected = np.where(np.abs(original[name]) >= cutoff, np.clip(original[name], -gamma, gamma), 0)
        np.testing.assert_array_equal(tensor.numpy(), expected)
        assert tensor is params[name]  # changed in place, not copied


def test_filter_works_on_a_weight_diff_dxo_and_numpy_arrays() -> None:
    arrays = {"w": np.linspace(-1, 1, 101, dtype=np.float32), "b": np.array([0.5, -0.001], dtype=np.float32)}
    cutoff = np.percentile(np.abs(np.concatenate(list(arrays.values()))), 20)
    expected = {k: np.where(np.abs(v) >= cutoff, np.clip(v, -0.1, 0.1), 0) for k, v in arrays.items()}
    shareable = DXO(DataKind.WEIGHT_DIFF, arrays).to_shareable()

    PercentilePrivacy(percentile=20, gamma=0.1).process(shareable, "site-1")

    for name, array in DXO.from_shareable(shareable).data.items():
        np.testing.assert_array_equal(array, expected[name])


@pytest.mark.parametrize(
    "make",
    [
        lambda p: shareable_from_model(FLModel(params=p)),  # FULL by default
        lambda p: DXO(DataKind.WEIGHTS, p).to_shareable(),
    ],
    ids=["flmodel-full", "dxo-weights"],
)
def test_whole_weights_are_refused_with_the_fix(make: Any) -> None:
    params = random_update(6)
    before = {name: t.clone() for name, t in params.items()}

    with pytest.raises(ValueError, match=r"DIFF.*expected_params_type = DIFF"):
        PercentilePrivacy().process(make(params), "site-1")
    assert all(torch.equal(params[name], before[name]) for name in params)


def test_results_without_params_pass_through() -> None:
    shareable = shareable_from_model(FLModel(metrics={"accuracy": 0.9}))

    assert PercentilePrivacy().process(shareable, "site-1") is shareable
    assert PercentilePrivacy().process(Shareable(), "site-1") == Shareable()


class FakeLazy:
    """Stands for a lazy on-disk value (anything with resolve())."""

    def resolve(self) -> torch.Tensor:
        return torch.zeros(3)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (FakeLazy(), "lazy value on disk.*client's task_result_filters"),
        (torch.tensor([1, 2], dtype=torch.int64), "torch.int64.*ExcludeVars"),
        (torch.tensor([1.0, float("nan")]), "'bad' holds NaN or infinite values"),
        (torch.tensor([1.0, float("inf")]), "'bad' holds NaN or infinite values"),
        ([1.0, 2.0], "is a list, expected a tensor"),
    ],
    ids=["lazy", "integer", "nan", "inf", "list"],
)
def test_values_it_cannot_protect_are_refused(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PercentilePrivacy().process(diff_shareable({"ok": torch.ones(4), "bad": value}), "site-1")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"percentile": -1}, r"percentile: expected a number in \[0, 100\], got -1.0"),
        ({"percentile": 100.5}, r"percentile: expected a number in \[0, 100\]"),
        ({"percentile": float("nan")}, r"percentile: expected a number in \[0, 100\], got nan"),
        ({"percentile": "10"}, r"percentile: expected a number, got '10'"),
        ({"percentile": True}, r"percentile: expected a number, got True"),
        ({"gamma": 0}, r"gamma: expected a number in \(0, inf\]"),
        ({"gamma": -0.1}, r"gamma: expected a number in \(0"),
        ({"gamma": float("nan")}, r"gamma: expected a number in \(0, inf\], got nan"),
        ({"gamma": float("inf")}, r"gamma: expected a finite number > 0"),
    ],
    ids=["negative", "above-100", "nan", "string", "bool", "gamma-0", "gamma-negative", "gamma-nan", "gamma-inf"],
)
def test_hostile_args_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PercentilePrivacy(**kwargs)
