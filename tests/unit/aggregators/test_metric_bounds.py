"""Metrics a single site cannot steer: default ranges for bounded metrics, honest means unchanged."""

from __future__ import annotations

import pytest

from engine.aggregators import ResultRules, WeightedModelAggregator, default_metric_range
from engine.model import FLModel


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("accuracy", (0.0, 1.0)),
        ("global_accuracy", (0.0, 1.0)),
        ("val/f1", (0.0, 1.0)),
        ("eval.AUC", (0.0, 1.0)),
        ("loss", None),
        ("accuracy_percent", None),
    ],
    ids=["plain", "prefixed", "slash", "dotted-upper", "unbounded", "other-name"],
)
def test_default_range_by_name(name: str, expected: tuple[float, float] | None) -> None:
    assert default_metric_range(name) == expected


def test_a_huge_accuracy_is_dropped_without_a_declared_range(caplog: pytest.LogCaptureFixture) -> None:
    rules = ResultRules.from_args()

    accepted = rules.accepted_metrics({"global_accuracy": 1e9, "loss": 3.5}, "site-3", 0)

    assert accepted == {"loss": 3.5}
    assert "1000000000.0 is outside the default range [0, 1]" in caplog.text


def test_a_declared_range_replaces_the_default() -> None:
    rules = ResultRules.from_args(metric_ranges={"accuracy": [0, 100]})

    assert rules.accepted_metrics({"accuracy": 87.5}, "site-1", 0) == {"accuracy": 87.5}
    assert rules.accepted_metrics({"accuracy": 101.0}, "site-1", 0) == {}


def _round_metric(reports: dict[str, float], rules: ResultRules) -> float:
    aggregator = WeightedModelAggregator()
    for site, value in reports.items():
        metrics = rules.accepted_metrics({"global_accuracy": value}, site, 0)
        aggregator.accept_model(FLModel(params={}, metrics=metrics, meta={"NUM_STEPS_CURRENT_ROUND": 1}), site)
    return aggregator.aggregate_model().metrics["global_accuracy"]


def test_honest_means_are_unchanged_and_a_liar_moves_the_mean_by_its_share_at_most() -> None:
    rules = ResultRules.from_args()
    honest = {"site-1": 0.5, "site-2": 0.6, "site-3": 0.7}

    assert _round_metric(honest, rules) == pytest.approx(0.6)
    lied = _round_metric({**honest, "site-4": 1.0}, rules)  # the most a liar can claim
    assert lied == pytest.approx((0.5 + 0.6 + 0.7 + 1.0) / 4)
    assert _round_metric({**honest, "site-4": 1e9}, rules) == pytest.approx(0.6)  # dropped: the others' mean
