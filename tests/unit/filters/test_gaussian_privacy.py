"""GaussianPrivacy: exact clipping, noise statistics, and the epsilon dp_accounting gives for the same run."""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from engine.filters import GaussianPrivacy
from engine.filters.epsilon import gaussian_epsilon
from engine.model import DXO, DataKind, FLModel, ParamsType, ReservedHeaderKey, Shareable, shareable_from_model


def diff_shareable(params: dict[str, Any], current_round: int | None = None) -> Shareable:
    shareable = shareable_from_model(FLModel(params=params, params_type=ParamsType.DIFF))
    if current_round is not None:
        shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, current_round)
    return shareable


def l2(params: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in params.values()))


def expected_epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """dp_accounting's own value: ``rounds`` sampled Gaussian events composed by its RDP accountant."""
    accountant = rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_an_update_above_the_norm_is_scaled_onto_it(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(40, 30, generator=generator, dtype=dtype), "b": torch.randn(30, dtype=dtype)}
    original = {name: t.clone() for name, t in params.items()}
    norm = l2(params)

    GaussianPrivacy(clip_norm=2.5, noise_multiplier=0.0).process(diff_shareable(params), "site-1")

    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    assert l2(params) == pytest.approx(2.5, rel=tolerance)
    for name, tensor in params.items():  # the direction is kept: every value scaled alike
        torch.testing.assert_close(tensor, original[name] * (2.5 / norm), rtol=tolerance, atol=0)


def test_an_update_within_the_norm_is_unchanged_without_noise() -> None:
    params = {"w": torch.full((10,), 0.1)}  # norm 0.316
    before = params["w"].clone()

    GaussianPrivacy(clip_norm=1.0, noise_multiplier=0.0).process(diff_shareable(params), "site-1")

    assert torch.equal(params["w"], before)


def test_noise_has_the_configured_standard_deviation_and_repeats_with_its_seed() -> None:
    clip_norm, noise_multiplier, n = 2.0, 0.75, 1 << 20
    std = clip_norm * noise_multiplier
    first = {"a": torch.zeros(n // 2), "b": torch.zeros(n // 4, 4)}  # a zero update: no clipping

    GaussianPrivacy(clip_norm=clip_norm, noise_multiplier=noise_multiplier, seed=7).process(
        diff_shareable(first), "site-1"
    )

    values = np.concatenate([t.numpy().ravel() for t in first.values()])
    assert abs(values.mean()) < 5 * std / math.sqrt(n)  # 5 standard errors
    assert values.std() == pytest.approx(std, rel=0.01)  # the std's standard error is ~0.07 %
    assert abs(float(np.corrcoef(values[:-1], values[1:])[0, 1])) < 0.01  # independent values
    again = {"a": torch.zeros(n // 2), "b": torch.zeros(n // 4, 4)}
    GaussianPrivacy(clip_norm=clip_norm, noise_multiplier=noise_multiplier, seed=7).process(
        diff_shareable(again), "site-1"
    )
    assert all(torch.equal(first[name], again[name]) for name in first)
    other = {"a": torch.zeros(n // 2), "b": torch.zeros(n // 4, 4)}
    GaussianPrivacy(clip_norm=clip_norm, noise_multiplier=noise_multiplier, seed=8).process(
        diff_shareable(other), "site-1"
    )
    assert not torch.equal(first["a"], other["a"])


@pytest.mark.parametrize(
    ("noise_multiplier", "sampling_rate", "rounds"), [(1.1, 1.0, 4), (0.8, 0.25, 2)], ids=["all", "sampled"]
)
def test_epsilon_is_dp_accountings_own_and_rises_with_rounds(
    noise_multiplier: float, sampling_rate: float, rounds: int, caplog: pytest.LogCaptureFixture
) -> None:
    privacy = GaussianPrivacy(clip_norm=1.0, noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, seed=1)
    reported = []

    with caplog.at_level(logging.INFO, logger="engine.filters.gaussian_privacy"):
        for current_round in range(rounds):
            result = privacy.process(diff_shareable({"w": torch.ones(8)}, current_round), "site-2")
            reported.append(result["FLModel"].metrics["dp_epsilon"])

    expected = [expected_epsilon(noise_multiplier, sampling_rate, r, 1e-5) for r in range(1, rounds + 1)]
    assert reported == pytest.approx(expected, rel=1e-9)
    assert reported == sorted(reported) and len(set(reported)) == rounds
    assert f"dp epsilon site=site-2 round={rounds} epsilon={expected[-1]:.4f} delta=1e-05" in caplog.text


def test_every_round_up_to_the_results_counts_and_a_stale_round_cannot_lower_epsilon() -> None:
    privacy = GaussianPrivacy(clip_norm=1.0, noise_multiplier=1.0, sampling_rate=1.0, delta=1e-6)

    late = privacy.process(diff_shareable({"w": torch.ones(3)}, current_round=9), "site-1")
    # Two more results that claim the first round: at least one round per result is composed.
    privacy.process(diff_shareable({"w": torch.ones(3)}, current_round=0), "site-1")
    stale = privacy.process(diff_shareable({"w": torch.ones(3)}, current_round=0), "site-1")

    assert late["FLModel"].metrics["dp_epsilon"] == pytest.approx(expected_epsilon(1.0, 1.0, 10, 1e-6))
    assert stale["FLModel"].metrics["dp_epsilon"] == pytest.approx(expected_epsilon(1.0, 1.0, 3, 1e-6))


def test_a_weight_diff_dxo_gets_the_epsilon_in_its_metrics_meta() -> None:
    shareable = DXO(
        DataKind.WEIGHT_DIFF, {"w": np.ones(5, dtype=np.float32)}, {"metrics": {"loss": 0.5}}
    ).to_shareable()
    shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, 0)

    GaussianPrivacy(clip_norm=1.0, noise_multiplier=1.0, seed=0).process(shareable, "site-1")

    dxo = DXO.from_shareable(shareable)
    assert dxo.meta["metrics"] == {"loss": 0.5, "dp_epsilon": pytest.approx(expected_epsilon(1.0, 1.0, 1, 1e-5))}
    assert l2({"w": torch.from_numpy(dxo.data["w"])}) != pytest.approx(math.sqrt(5))  # noised in place


def test_without_dp_accounting_it_noises_and_says_once_how_to_get_epsilon(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting raises ImportError
    gaussian_epsilon.cache_clear()
    privacy = GaussianPrivacy(clip_norm=1.0, noise_multiplier=1.0, seed=3)
    params = {"w": torch.zeros(100)}

    with caplog.at_level(logging.INFO, logger="engine.filters.gaussian_privacy"):
        first = privacy.process(diff_shareable(params, 0), "site-1")
        second = privacy.process(diff_shareable({"w": torch.zeros(3)}, 1), "site-1")

    gaussian_epsilon.cache_clear()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pip install flengine[privacy]" in warnings[0].getMessage()
    for result in (first, second):
        assert "dp_epsilon" not in (result["FLModel"].metrics or {})
        assert "pip install flengine[privacy]" in result["FLModel"].meta["dp_epsilon_note"]
    assert "dp epsilon site=site-1 round=2 epsilon=unknown" in caplog.text
    assert params["w"].abs().sum() > 0  # the noise is added all the same


def test_no_noise_means_no_finite_epsilon_and_no_metric() -> None:
    result = GaussianPrivacy(clip_norm=1.0, noise_multiplier=0.0).process(diff_shareable({"w": torch.ones(2)}, 0), "s")

    assert result["FLModel"].metrics is None
    assert "infinite" in result["FLModel"].meta["dp_epsilon_note"]


@pytest.mark.parametrize(
    "make",
    [lambda p: shareable_from_model(FLModel(params=p)), lambda p: DXO(DataKind.WEIGHTS, p).to_shareable()],
    ids=["flmodel-full", "dxo-weights"],
)
def test_whole_weights_are_refused_with_the_fix(make: Any) -> None:
    params = {"w": torch.ones(4)}

    with pytest.raises(ValueError, match=r"GaussianPrivacy protects a weight difference.*params_type=ParamsType.DIFF"):
        GaussianPrivacy(clip_norm=1.0, noise_multiplier=1.0).process(make(params), "site-1")
    assert torch.equal(params["w"], torch.ones(4))


def test_a_non_finite_update_is_refused_before_anything_changes() -> None:
    params = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")])}

    with pytest.raises(ValueError, match="'b' holds NaN or infinite values"):
        GaussianPrivacy(clip_norm=0.1, noise_multiplier=1.0).process(diff_shareable(params), "site-1")
    assert torch.equal(params["a"], torch.ones(3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_norm": 0}, r"clip_norm: expected a number in \(0, inf\], got 0.0"),
        ({"clip_norm": -1}, r"clip_norm: expected a number in \(0"),
        ({"clip_norm": float("nan")}, r"clip_norm: expected a number in \(0, inf\], got nan"),
        ({"clip_norm": float("inf")}, r"clip_norm: expected a finite number > 0"),
        ({"clip_norm": "1"}, r"clip_norm: expected a number, got '1'"),
        ({"noise_multiplier": -0.5}, r"noise_multiplier: expected a number in \[0, 1e\+06\]"),
        ({"noise_multiplier": float("nan")}, r"noise_multiplier: .* got nan"),
        ({"noise_multiplier": float("inf")}, r"noise_multiplier: .* got inf"),
        ({"delta": 0}, r"delta: expected a number in \(0, 1\]"),
        ({"delta": 1}, r"delta: expected a number in \(0, 1\), got 1"),
        ({"delta": float("nan")}, r"delta: .* got nan"),
        ({"sampling_rate": 0}, r"sampling_rate: expected a number in \(0, 1\]"),
        ({"sampling_rate": 1.5}, r"sampling_rate: expected a number in \(0, 1\]"),
        ({"seed": -1}, r"seed: expected an integer >= 0 or None, got -1"),
        ({"seed": 1.5}, r"seed: expected an integer >= 0 or None"),
    ],
    ids=[
        "clip-0",
        "clip-negative",
        "clip-nan",
        "clip-inf",
        "clip-string",
        "noise-negative",
        "noise-nan",
        "noise-inf",
        "delta-0",
        "delta-1",
        "delta-nan",
        "rate-0",
        "rate-above-1",
        "seed-negative",
        "seed-float",
    ],
)
def test_hostile_args_are_refused(kwargs: dict[str, Any], match: str) -> None:
    args = {"clip_norm": 1.0, "noise_multiplier": 1.0, **kwargs}

    with pytest.raises(ValueError, match=match):
        GaussianPrivacy(**args)
