"""A Swarm round at its aggregation client: results folded as they come, the round's exit rule."""

from __future__ import annotations

import threading
import time

import torch

from engine.aggregators import DXOAggregator
from engine.executors.ccwf.gathering import RoundGathering
from engine.model import DXO, DataKind, ReturnCode, Shareable, make_reply
from engine.model.ccwf import rotate


def result(value: float, steps: int, current_round: int = 0) -> Shareable:
    shareable = DXO(DataKind.WEIGHTS, {"w": torch.full((2,), value)}, {"NUM_STEPS_CURRENT_ROUND": steps}).to_shareable()
    shareable.set_return_code(ReturnCode.OK)
    shareable.set_header("current_round", current_round)
    return shareable


def test_the_round_is_done_when_every_trainer_answered_and_its_model_is_there() -> None:
    aggregator = DXOAggregator(expected_data_kind="WEIGHTS")
    gathering = RoundGathering(0, ["site-1", "site-2"])
    stop = threading.Event()

    gathering.take("site-1", result(1.0, 1), aggregator)
    gathering.fail("site-2", "the trainer's task failed")
    assert gathering.wait_done(1, 60.0, 0.5, stop) is True  # no model yet: only the timeout ends it
    gathering.set_base(result(0.0, 1))
    started = time.monotonic()

    assert gathering.wait_done(1, 60.0, 60.0, stop) is True
    assert time.monotonic() - started < 1.0
    assert gathering.accepted == ["site-1"] and gathering.failed == {"site-2": "the trainer's task failed"}
    aggregated = DXO.from_shareable(aggregator.aggregate(0)).data["w"]
    assert torch.equal(aggregated, torch.full((2,), 1.0))


def test_enough_results_end_the_round_after_the_extra_wait() -> None:
    aggregator = DXOAggregator(expected_data_kind="WEIGHTS")
    gathering = RoundGathering(0, ["site-1", "site-2", "site-3"], base=result(0.0, 1))
    for k in (1, 2):
        gathering.take(f"site-{k}", result(float(k), k * 100), aggregator)

    started = time.monotonic()
    assert gathering.wait_done(2, 0.5, 60.0, threading.Event()) is True

    assert 0.4 < time.monotonic() - started < 2.0
    aggregated = DXO.from_shareable(aggregator.aggregate(0)).data["w"]
    assert torch.allclose(aggregated, torch.full((2,), (1 * 100 + 2 * 200) / 300))


def test_a_failed_or_refused_result_is_recorded_and_the_job_stop_ends_the_wait() -> None:
    aggregator = DXOAggregator(expected_data_kind="WEIGHTS")
    gathering = RoundGathering(0, ["site-1", "site-2"], base=result(0.0, 1))
    failed = make_reply(ReturnCode.EXECUTION_EXCEPTION)
    failed.set_header("reason", "out of memory")

    gathering.take("site-1", failed, aggregator)
    gathering.take("site-2", result(1.0, 1, current_round=5), aggregator)  # another round's result
    stop = threading.Event()
    stop.set()

    assert gathering.failed == {
        "site-1": "return code EXECUTION_EXCEPTION: out of memory",
        "site-2": "the aggregator refused it (see the log)",
    }
    assert gathering.wait_done(1, 0.0, 60.0, stop) is False


def test_aggregation_moves_from_client_to_client() -> None:
    clients = ["site-1", "site-2", "site-3"]

    assert [rotate(clients, r)[0] for r in range(4)] == ["site-1", "site-2", "site-3", "site-1"]
    assert rotate(clients, 1) == ["site-2", "site-3", "site-1"]


def test_a_metric_only_one_accepted_trainer_reported_is_named_for_the_persistor() -> None:
    aggregator = DXOAggregator(expected_data_kind="WEIGHTS")
    gathering = RoundGathering(0, ["site-1", "site-2", "site-3"], base=result(0.0, 1))

    def with_metrics(value: float, metrics: dict[str, float]) -> Shareable:
        shareable = result(value, 1)
        DXO.from_shareable(shareable).meta["metrics"] = metrics
        return shareable

    gathering.take("site-1", with_metrics(1.0, {"accuracy": 0.99, "loss": 0.1}), aggregator)
    gathering.take("site-2", with_metrics(2.0, {"accuracy": 5.0, "loss": 0.3}), aggregator)  # accuracy out of range
    gathering.take("site-3", with_metrics(float("nan"), {"accuracy": 0.98, "loss": 0.2}), aggregator)  # refused

    assert gathering.accepted == ["site-1", "site-2"] and "site-3" in gathering.failed
    assert gathering.metrics_from_one_site(job_clients=3) == ["accuracy"]
    assert gathering.metrics_from_one_site(job_clients=1) == []
    assert DXO.from_shareable(aggregator.aggregate(0)).meta["metrics"] == {"accuracy": 0.99, "loss": 0.2}
