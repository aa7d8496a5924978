"""`MetricsIntake`: what a site sends is checked, limited and numbered before any receiver sees it."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.metrics import JsonLinesReceiver, Metric, MetricLimits, MetricsIntake, MetricsReceiver
from engine.metrics.intake import DROPS


class Collect(MetricsReceiver):
    """A receiver that keeps what it gets (a real one: the intake cannot tell it from any other)."""

    def __init__(self) -> None:
        self.metrics: list[Metric] = []
        self.closed = 0

    def receive(self, metric: Metric) -> None:
        self.metrics.append(metric)

    def close(self) -> None:
        self.closed += 1


class Broken(MetricsReceiver):
    def receive(self, metric: Metric) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        raise OSError("disk full")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def fresh_log_budget() -> None:
    DROPS.reset()


def make(limits: MetricLimits | None = None, clock: Clock | None = None) -> tuple[MetricsIntake, Collect]:
    sink = Collect()
    intake = MetricsIntake(
        [sink], ["site-1", "site-2"], "server", limits, clock=clock or Clock(), wall_clock=lambda: 1234.5
    )
    return intake, sink


@pytest.mark.parametrize(
    ("key", "value", "current_round"),
    [
        ("a b", 1.0, 0),
        ("\x1b[31mred", 1.0, 0),
        ("../../etc/passwd", 1.0, 0),
        ("/abs", 1.0, 0),
        ("k" * 129, 1.0, 0),
        ("", 1.0, 0),
        (7, 1.0, 0),
        (None, 1.0, 0),
        ("loss", "0.5", 0),
        ("loss", None, 0),
        ("loss", [1.0], 0),
        ("loss", {"v": 1}, 0),
        ("loss", b"\x00", 0),
        ("loss", True, 0),
        ("loss", math.nan, 0),
        ("loss", math.inf, 0),
        ("loss", -math.inf, 0),
        ("loss", 10**400, 0),
        ("loss", 1.0, "1"),
        ("loss", 1.0, -1),
        ("loss", 1.0, 10**12),
        ("loss", 1.0, True),
        ("loss", 1.0, 1.5),
    ],
    ids=[
        "space", "escape-codes", "dot-dot-path", "absolute", "129-chars", "empty", "int-key", "none-key",
        "string", "none", "list", "dict", "bytes", "bool", "nan", "inf", "-inf", "int-beyond-float",
        "round-string", "round-negative", "round-huge", "round-bool", "round-float",
    ],
)  # fmt: skip
def test_a_bad_metric_is_dropped_and_no_receiver_sees_it(key: Any, value: Any, current_round: Any) -> None:
    intake, sink = make()

    written = intake.from_site("site-1", key, value, current_round)

    assert written is False
    assert sink.metrics == []
    assert intake.dropped == {"refused": 1}


@pytest.mark.parametrize(
    ("value", "expected"),
    [(3, 3.0), (0.25, 0.25), (np.float32(0.5), 0.5), (np.int64(-2), -2.0), (1e300, 1e300)],
    ids=["int", "float", "numpy-float32", "numpy-int64", "large-finite"],
)
def test_a_finite_number_is_written_as_a_float(value: Any, expected: float) -> None:
    intake, sink = make()

    assert intake.from_site("site-1", "train/loss:ce@1+x-y", value, 0) is True

    assert sink.metrics == [Metric("site-1", "train/loss:ce@1+x-y", expected, 1, 1, 1234.5)]
    assert type(sink.metrics[0].value) is float


@pytest.mark.parametrize(
    "sender", ["server", "site-3", "site-1 (of another job)", "", "../site-1"], ids=str
)  # fmt: skip
def test_only_the_jobs_clients_may_send(sender: str) -> None:
    intake, sink = make()

    assert intake.from_site(sender, "loss", 1.0, 0) is False

    assert sink.metrics == []
    assert intake.dropped == {"sender": 1}


def test_a_client_named_like_the_server_is_refused() -> None:
    sink = Collect()
    intake = MetricsIntake([sink], ["server", "site-1"], "server")

    assert intake.from_site("server", "loss", 1.0, 0) is False
    assert intake.from_site("site-1", "loss", 1.0, 0) is True


def test_steps_follow_the_round_when_a_key_is_logged_once_a_round_and_count_on_otherwise() -> None:
    intake, sink = make()
    # rounds (0-based, as sent) of each log call of each key
    once = [0, 1, 3]  # round 3 (1-based) skipped
    thrice = [0, 0, 0, 1, 1, 1, 2]
    for current_round in once:
        intake.from_site("site-1", "acc", 0.5, current_round)
    for current_round in thrice:
        intake.from_site("site-1", "loss", 0.5, current_round)
    for _ in range(2):
        intake.from_site("site-1", "free", 0.5, None)

    def expected_steps(rounds: list[int | None]) -> list[int]:  # the documented rule, step by step
        steps, last = [], 0
        for r in rounds:
            last = max(0 if r is None else r + 1, last + 1)
            steps.append(last)
        return steps

    steps = {key: [m.step for m in sink.metrics if m.key == key] for key in ("acc", "loss", "free")}
    assert steps == {"acc": [1, 2, 4], "loss": [1, 2, 3, 4, 5, 6, 7], "free": [1, 2]}
    assert steps["acc"] == expected_steps(once) and steps["loss"] == expected_steps(thrice)
    assert [m.round for m in sink.metrics if m.key == "acc"] == [1, 2, 4]
    assert [m.round for m in sink.metrics if m.key == "free"] == [None, None]


def test_each_site_counts_its_own_steps() -> None:
    intake, sink = make()

    for site in ("site-1", "site-1", "site-2"):
        intake.from_site(site, "loss", 1.0, 0)

    assert [(m.site, m.step) for m in sink.metrics] == [("site-1", 1), ("site-1", 2), ("site-2", 1)]


def test_a_site_over_its_rate_is_dropped_until_its_bucket_refills() -> None:
    clock = Clock()
    intake, sink = make(MetricLimits(per_second=10, burst=5), clock)

    first = [intake.from_site("site-1", "loss", float(i), 0) for i in range(20)]
    other_site = intake.from_site("site-2", "loss", 1.0, 0)
    clock.now += 0.5  # 0.5 s x 10 a second = 5 more
    later = [intake.from_site("site-1", "loss", float(i), 0) for i in range(20)]

    assert first.count(True) == 5 and later.count(True) == 5
    assert other_site is True  # one site's flood does not spend another's budget
    assert intake.dropped == {"rate": 30}
    assert len(sink.metrics) == 11


def test_a_site_gets_per_site_metrics_in_the_whole_job() -> None:
    clock = Clock()
    intake, sink = make(MetricLimits(per_second=1000, burst=1000, per_site=3), clock)

    results = []
    for i in range(6):
        clock.now += 10.0
        results.append(intake.from_site("site-1", "loss", float(i), i))

    assert results == [True, True, True, False, False, False]
    assert intake.dropped == {"total": 3}


def test_a_site_gets_keys_per_site_distinct_keys() -> None:
    intake, sink = make(MetricLimits(keys_per_site=2))

    assert [intake.from_site("site-1", key, 1.0, 0) for key in ("a", "b", "c", "a")] == [True, True, False, True]
    assert intake.dropped == {"keys": 1}


def test_a_flood_of_metrics_writes_one_burst_and_a_few_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    intake, sink = make(MetricLimits(burst=1000), Clock())  # the clock stands still: no refill

    with caplog.at_level(logging.WARNING, logger="engine.metrics.intake"):
        for i in range(20_000):
            intake.from_site("site-1", f"k{i % 10}", float(i), 0)
            intake.from_site("site-2", "bad key", float(i), 0)

    assert len(sink.metrics) == 1000
    assert intake.dropped == {"rate": 19_000, "refused": 20_000}
    assert len(caplog.records) <= 10  # per kind of line, a few a minute


def test_the_servers_round_metrics_are_written_under_its_name_without_a_rate_limit() -> None:
    intake, sink = make(MetricLimits(per_second=1, burst=1))

    written = [
        intake.from_server({"global_accuracy": 0.8 + r / 100, "bad key": 1.0, "nan": math.nan}, r) for r in range(3)
    ]

    assert written == [1, 1, 1]
    assert [(m.site, m.key, m.round, m.step) for m in sink.metrics] == [
        ("server", "global_accuracy", 1, 1),
        ("server", "global_accuracy", 2, 2),
        ("server", "global_accuracy", 3, 3),
    ]
    assert [m.value for m in sink.metrics] == pytest.approx([0.8, 0.81, 0.82])
    assert intake.from_server(None, 0) == 0 and intake.from_server("not a dict", 0) == 0


def test_a_receiver_that_raises_does_not_stop_the_others_and_close_reaches_every_one() -> None:
    sink = Collect()
    intake = MetricsIntake([Broken(), sink], ["site-1"])

    assert intake.from_site("site-1", "loss", 1.0, 0) is True
    intake.close()
    intake.close()

    assert len(sink.metrics) == 1
    assert sink.closed == 1
    assert intake.from_site("site-1", "loss", 1.0, 1) is False
    assert intake.dropped == {"closed": 1}


def test_for_components_takes_the_receivers_of_the_config_in_order(tmp_path: Path) -> None:
    first, second = Collect(), Collect()

    intake = MetricsIntake.for_components({"p": object(), "a": first, "b": second}, tmp_path, ["site-1"])

    assert intake.receivers == [first, second]


def test_without_a_receiver_the_metrics_go_to_the_servers_metrics_jsonl(tmp_path: Path) -> None:
    intake = MetricsIntake.for_components({"persistor": object()}, tmp_path, ["site-1"])
    intake.from_site("site-1", "loss", 0.5, 2)
    intake.close()

    (receiver,) = intake.receivers
    assert isinstance(receiver, JsonLinesReceiver)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize(
    "limits", [{"per_second": 0}, {"burst": -1}, {"per_site": True}, {"keys_per_site": "9"}], ids=str
)
def test_limits_must_be_positive_numbers(limits: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"^{next(iter(limits))}: expected a number > 0"):
        MetricLimits(**limits)
