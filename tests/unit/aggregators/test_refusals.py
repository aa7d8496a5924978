"""Refusals are `ResultRefused`, everywhere a result is checked; anything else is recorded as a bug (`record_refusal`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch

from engine.aggregators import (
    CoordinateMedianAggregator,
    DXOAggregator,
    DXOAggregatorAsModel,
    KrumAggregator,
    NormClippingAggregator,
    ResultRules,
    WeightedAggregationHelper,
    WeightedModelAggregator,
    check_params_match,
)
from engine.aggregators.check import check_finite
from engine.aggregators.dxo_aggregator import acceptable_dxo
from engine.aggregators.folding import FoldingModelAggregator
from engine.aggregators.refusals import record_refusal
from engine.errors import ResultRefused
from engine.model import DXO, DataKind, FLModel, ParamsType, ReturnCode, Shareable


def _twice(aggregator: object) -> None:
    for _ in range(2):  # DIFFs: a clipping aggregator needs no global model for them
        model = FLModel(params={"w": torch.ones(2)}, params_type=ParamsType.DIFF, meta={"NUM_STEPS_CURRENT_ROUND": 1})
        aggregator.accept_model(model, "site-1")  # type: ignore[attr-defined]


def _no_dxo() -> None:
    ResultRules().check_dxo_result(Shareable(), "site-1", 0)


def _error_code() -> None:
    result = DXO(DataKind.WEIGHTS, {"w": np.ones(2)}).to_shareable()
    result.set_return_code(ReturnCode.EXECUTION_EXCEPTION)
    acceptable_dxo(result, 0, DataKind.WEIGHTS)


def _refused_by_a_dxo_aggregator() -> None:
    adapter = DXOAggregatorAsModel(DXOAggregator(expected_data_kind="WEIGHTS"))
    adapter.start_round(0, dict)
    adapter.accept_model(FLModel(params={"w": torch.ones(1)}, meta={"NUM_STEPS_CURRENT_ROUND": -3}), "site-1")


def _heavy(aggregator: object) -> None:
    model = FLModel(params={"w": torch.ones(2)}, meta={"NUM_STEPS_CURRENT_ROUND": 10**12})
    aggregator.accept_model(model, "site-1")  # type: ignore[attr-defined]


REFUSALS: dict[str, Callable[[], object]] = {
    "layout-unlike-the-model": lambda: check_params_match({"w": torch.zeros(2)}, {"w": torch.zeros(3)}, "site-1"),
    "non-finite-values": lambda: check_finite({"w": torch.tensor([float("nan")])}, "site-1"),
    "a-value-of-no-kind": lambda: WeightedAggregationHelper().add({"w": "text"}, 1.0, "site-1", 0),
    "weighted-second-result": lambda: _twice(WeightedModelAggregator()),
    "folding-second-result": lambda: _twice(FoldingModelAggregator()),
    "median-second-result": lambda: _twice(CoordinateMedianAggregator()),
    "krum-second-result": lambda: _twice(KrumAggregator(num_byzantine=0)),
    "clipping-second-result": lambda: _twice(NormClippingAggregator(max_norm=1.0)),
    "weighted-weight-above-the-bound": lambda: _heavy(WeightedModelAggregator()),
    "folding-weight-above-the-bound": lambda: _heavy(FoldingModelAggregator()),
    "dxo-result-without-a-dxo": _no_dxo,
    "dxo-result-with-an-error-code": _error_code,
    "refused-by-the-wrapped-dxo-aggregator": _refused_by_a_dxo_aggregator,
}


@pytest.mark.parametrize("refuse", list(REFUSALS.values()), ids=list(REFUSALS))
def test_every_check_refuses_with_result_refused(refuse: Callable[[], object]) -> None:
    with pytest.raises(ResultRefused):
        refuse()


@pytest.mark.parametrize(
    ("error", "refused", "reason", "traceback"),
    [
        (ResultRefused("result of site-1: no epoch"), True, "result of site-1: no epoch", False),
        (
            ValueError("math domain error"),
            False,
            "checking the result raised ValueError: math domain error (a bug in the server's checks, not a refusal "
            "by the site; the traceback is in the server's log)",
            True,
        ),
        (KeyError("acc"), False, "checking the result raised KeyError: 'acc' (a bug in the server's checks", True),
    ],
    ids=["refusal", "value-error-is-a-bug", "key-error-is-a-bug"],
)
def test_record_refusal_tells_a_refusal_from_a_bug(
    caplog: pytest.LogCaptureFixture, error: Exception, refused: bool, reason: str, traceback: bool
) -> None:
    failures: dict[str, str] = {}
    refusals: dict[str, str] = {}

    with caplog.at_level(logging.WARNING, logger="engine.aggregators.refusals"):
        recorded = record_refusal(error, "site-1", 0, failures, refusals)

    assert recorded.startswith(reason) and failures == {"site-1": recorded}
    assert refusals == ({"site-1": recorded} if refused else {})
    (record,) = caplog.records
    assert record.levelno == (logging.WARNING if refused else logging.ERROR)
    assert (record.exc_info is not None) is traceback
    assert "site=site-1 round=1" in record.getMessage()


def test_a_bugs_traceback_is_left_to_the_caller_when_it_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.aggregators.refusals"):
        record_refusal(ValueError("x"), "site-1", 0, {}, {}, with_traceback=False)

    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is None
