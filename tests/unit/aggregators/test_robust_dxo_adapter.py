"""ModelAggregatorAsDXO: the robust aggregators on the ScatterAndGather path, built from a config."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.aggregators import (
    CoordinateMedianAggregator,
    KrumAggregator,
    ModelAggregatorAsDXO,
    NormClippingAggregator,
    TrimmedMeanAggregator,
)
from engine.config import ComponentSpec, build_component
from engine.config.source import load_config
from engine.errors import ComponentBuildError
from engine.model import DXO, DataKind, MetaKey, ReservedHeaderKey, ReturnCode, Shareable, make_reply


def shareable(
    value: float = 1.0,
    kind: DataKind = DataKind.WEIGHT_DIFF,
    round_header: int | None = 0,
    metrics: dict | None = None,
    size: int = 2,
) -> Shareable:
    meta: dict = {MetaKey.NUM_STEPS_CURRENT_ROUND: 1}
    if metrics is not None:
        meta["metrics"] = metrics
    result = DXO(kind, {"w": torch.full((size,), value)}, meta).to_shareable()
    if round_header is not None:
        result.set_header(ReservedHeaderKey.CURRENT_ROUND, round_header)
    return result


def failed() -> Shareable:
    result = shareable()
    result.set_return_code(ReturnCode.EXECUTION_EXCEPTION)
    return result


def test_the_median_of_dxo_results_comes_back_as_a_dxo_of_the_same_kind() -> None:
    aggregator = ModelAggregatorAsDXO(CoordinateMedianAggregator())
    for i, value in enumerate([1.0, 2.0, 100.0]):
        assert aggregator.accept(shareable(value, metrics={"loss": value}), f"site-{i}", 0)

    dxo = DXO.from_shareable(aggregator.aggregate(0))

    assert dxo.data_kind is DataKind.WEIGHT_DIFF
    assert dxo.data["w"].tolist() == [2.0, 2.0]
    assert dxo.meta == {"nr_aggregated": 3, "current_round": 0, "metrics": {"loss": 2.0}}


def test_krums_selection_rides_in_the_dxo_meta() -> None:
    aggregator = ModelAggregatorAsDXO(KrumAggregator(num_byzantine=1), expected_data_kind="WEIGHTS")
    for i, value in enumerate([1.0, 1.1, 1.2, 1.3, -500.0]):
        aggregator.accept(shareable(value, kind=DataKind.WEIGHTS, round_header=4), f"site-{i}", 4)

    dxo = DXO.from_shareable(aggregator.aggregate(4))

    assert dxo.data_kind is DataKind.WEIGHTS and dxo.meta["current_round"] == 4
    assert dxo.meta["selected"] in (["site-1"], ["site-2"]) and "site-4" in dxo.meta["krum_scores"]


@pytest.mark.parametrize(
    ("make", "logged"),
    [
        (failed, "reason=return code is EXECUTION_EXCEPTION"),
        (lambda: make_reply(ReturnCode.TASK_ABORTED), "reason=return code is TASK_ABORTED"),
        (lambda: shareable(kind=DataKind.WEIGHTS), "reason=data kind is WEIGHTS, expected WEIGHT_DIFF"),
        (lambda: shareable(round_header=1), "reason=it is a result of round 2"),
        (Shareable, "reason=the shareable carries no DXO"),
        (
            lambda: shareable(size=3),
            r"reason=result of site-2 does not match the model: 'w': shape (3,), expected (2,)",
        ),
        (shareable, "reason=site-1 already contributed to this round"),
    ],
    ids=["failed", "empty-reply", "wrong-kind", "wrong-round", "no-dxo", "wrong-shape", "duplicate"],
)
def test_refused_results_are_logged_and_the_others_aggregated(
    make: Callable[[], Shareable], logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    aggregator = ModelAggregatorAsDXO(TrimmedMeanAggregator(trim_fraction=0.1))
    aggregator.accept(shareable(), "site-1", 0)
    contributor = "site-1" if logged.endswith("already contributed to this round") else "site-2"

    with caplog.at_level(logging.INFO, logger="engine.aggregators"):
        accepted = aggregator.accept(make(), contributor, 0)

    assert accepted is False
    assert logged in caplog.text
    assert DXO.from_shareable(aggregator.aggregate(0)).meta["nr_aggregated"] == 1


def test_start_round_reaches_the_wrapped_aggregator() -> None:
    aggregator = ModelAggregatorAsDXO(NormClippingAggregator(max_norm=1.0), expected_data_kind="WEIGHTS")
    aggregator.start_round(0, lambda: {"w": torch.zeros(2)})

    assert aggregator.accept(shareable(3.0, kind=DataKind.WEIGHTS), "site-1", 0)

    data = DXO.from_shareable(aggregator.aggregate(0)).data
    assert torch.allclose(data["w"], torch.full((2,), 2**-0.5))  # the update (3, 3) clipped to norm 1


def test_reset_forgets_the_accepted_results() -> None:
    aggregator = ModelAggregatorAsDXO(CoordinateMedianAggregator())
    aggregator.accept(shareable(), "site-1", 0)

    aggregator.reset()

    with pytest.raises(RuntimeError, match="nothing to aggregate"):
        aggregator.aggregate(0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"aggregator": object()}, TypeError, r"aggregator: expected a ModelAggregator, e.g. \{ path = engine.aggregators.TrimmedMeanAggregator"),
        ({"aggregator": CoordinateMedianAggregator(), "expected_data_kind": "METRICS"}, ValueError, r"expected_data_kind: expected one of WEIGHTS, WEIGHT_DIFF, got 'METRICS'"),
        ({"aggregator": CoordinateMedianAggregator(), "expected_data_kind": "DIFF"}, ValueError, r"expected_data_kind: expected one of WEIGHTS, WEIGHT_DIFF, got 'DIFF'"),
    ],
    ids=["not-a-model-aggregator", "metrics", "unknown-kind"],
)  # fmt: skip
def test_bad_args_are_refused(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ModelAggregatorAsDXO(**kwargs)


CONFIG = """
components = [
  { id = robust, path = engine.aggregators.TrimmedMeanAggregator, args { trim_fraction = 0.2 } }
  {
    id = aggregator
    path = engine.aggregators.ModelAggregatorAsDXO
    args {
      expected_data_kind = WEIGHTS
      aggregator { path = engine.aggregators.KrumAggregator, args { num_byzantine = 1, num_selected = 2 } }
    }
  }
  { id = clip, path = engine.aggregators.NormClippingAggregator, args { max_norm = 5.0 } }
  { id = median, path = engine.aggregators.CoordinateMedianAggregator }
  { id = bad, path = engine.aggregators.TrimmedMeanAggregator, args { trim_fraction = 0.7 } }
]
"""


def test_a_config_names_each_aggregator_and_its_args(tmp_path: Path) -> None:
    path = tmp_path / "config_fed_server.conf"
    path.write_text(CONFIG, encoding="utf-8")
    document = load_config(path, "config_fed_server.conf", tmp_path)
    entries = document.data["components"]

    built = [build_component(ComponentSpec.from_entry(entries[i], ("components", i)), document) for i in range(4)]

    assert [type(component).__name__ for component in built] == [
        "TrimmedMeanAggregator",
        "ModelAggregatorAsDXO",
        "NormClippingAggregator",
        "CoordinateMedianAggregator",
    ]
    assert isinstance(built[1].aggregator, KrumAggregator) and built[1].aggregator.needed_results() == 5
    with pytest.raises(
        ComponentBuildError,
        match=r"config_fed_server.conf:\d+: components\[4\]: building engine.aggregators.TrimmedMeanAggregator "
        r"failed: ValueError: trim_fraction: expected a number in \[0, 0.5\), got 0.7",
    ):
        build_component(ComponentSpec.from_entry(entries[4], ("components", 4)), document)
