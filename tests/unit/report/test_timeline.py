"""Round phases and transfers from events with known times: each phase ends with the last site through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.report.timeline import build_timeline
from engine.report.workspace import ProcessData, RunData


def event(name: str, at: float, **fields) -> dict:
    return {"event": name, "at": at, **fields}


def two_site_round() -> RunData:
    """Round 1 from t=100 to t=110; site-1 is quick, site-2 the slowest at every step."""
    server = [
        event("round_started", 100.0, round=1),
        event("task_sent", 100.1, site="site-1", task="train", task_id="a", round=1),
        event("task_sent", 100.2, site="site-2", task="train", task_id="b", round=1),
        event("result_uploading", 104.0, site="site-1", task="train", task_id="a"),
        event("result_received", 104.5, site="site-1", task="train", task_id="a", bytes=2**20, seconds=0.5),
        event("result_uploading", 107.0, site="site-2", task="train", task_id="b"),
        event("result_received", 108.0, site="site-2", task="train", task_id="b", bytes=2**21, seconds=1.0),
        event("round_done", 110.0, round=1, time_s=10.0),
    ]
    site_1 = [
        event("task_received", 100.6, task="train", task_id="a", round=1, bytes=2**20, seconds=0.5),
        event("task_done", 104.0, task="train", task_id="a", round=1, seconds=3.4),
    ]
    site_2 = [
        event("task_received", 101.2, task="train", task_id="b", round=1, bytes=2**20, seconds=1.0),
        event("task_done", 106.9, task="train", task_id="b", round=1, seconds=5.7),
        # a client speaking for another site's task is not believed
        event("task_received", 109.0, task="train", task_id="a", round=1, bytes=9, seconds=0.1),
    ]
    processes = {
        "server": ProcessData("server", events=server),
        "site-1": ProcessData("site-1", events=site_1),
        "site-2": ProcessData("site-2", events=site_2),
    }
    return RunData(Path("ws"), processes=processes)


def test_phases_end_when_the_last_site_is_through() -> None:
    timeline = build_timeline(two_site_round())

    (timing,) = timeline.rounds
    assert (timing.round, timing.seconds) == (1, 10.0)
    assert timing.phases == pytest.approx(
        {"sending": 101.2 - 100.0, "training": 106.9 - 101.2, "receiving": 108.0 - 106.9, "aggregating": 110.0 - 108.0}
    )


def test_transfers_and_their_speed() -> None:
    timeline = build_timeline(two_site_round())

    moved = [(t.direction, t.site, t.bytes, t.mib_per_s) for t in timeline.transfers]
    assert moved == [
        ("download", "site-1", 2**20, pytest.approx(2.0)),
        ("download", "site-2", 2**20, pytest.approx(1.0)),
        ("upload", "site-1", 2**20, pytest.approx(2.0)),
        ("upload", "site-2", 2**21, pytest.approx(2.0)),
    ]
    assert timeline.origin == 100.0


def test_a_round_without_client_events_is_not_split() -> None:
    data = two_site_round()
    data.processes["site-2"].events = []

    (timing,) = build_timeline(data).rounds

    assert timing.phases == {} and timing.seconds == 10.0
