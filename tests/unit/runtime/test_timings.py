"""`RunTimings`: the stages of a run, in seconds since its start, as summary.json and ``-v`` show them."""

from __future__ import annotations

import pytest

from engine.runtime.timings import STAGES, RunTimings, timing_lines

START = 1_000.0


def events_of_a_run() -> list[dict[str, object]]:
    return [
        {"event": "listening", "at": START + 1.5, "endpoint": "tcp://127.0.0.1:1"},
        {"event": "workflow_started", "at": START + 1.75},
        {"event": "round_started", "at": START + 1.8, "round": 1},
        {"event": "round_done", "at": START + 3.0, "round": 1},
        {"event": "round_started", "at": START + 3.1, "round": 2},
        {"event": "round_done", "at": START + 4.8, "round": 2},
        {"event": "job_done", "at": START + 5.0},
    ]


def test_stages_come_from_the_server_events_in_order_with_the_first_and_last_rounds() -> None:
    timings = RunTimings(started=START)
    timings.mark("launcher_ready", START + 1.25)
    for event in events_of_a_run():
        timings.from_event(event)
    timings.client_ready("site-2", START + 1.7)
    timings.client_ready("site-1", START + 1.6)
    timings.mark("processes_exited", START + 5.5)
    timings.mark("summary_written", START + 5.625)

    summary = timings.to_summary()

    assert list(summary["stages"]) == list(STAGES)
    assert summary["stages"]["first_round_started"] == pytest.approx(1.8)  # the first round's start
    assert summary["stages"]["last_round_done"] == pytest.approx(4.8)  # the last round's end
    assert summary["stages"]["clients_ready"] == pytest.approx(1.7)  # the last client
    assert summary["clients_ready"] == {"site-1": pytest.approx(1.6), "site-2": pytest.approx(1.7)}
    assert summary["outside_rounds_s"] == pytest.approx(5.625 - (4.8 - 1.8))


def test_a_run_that_never_started_a_round_has_only_the_stages_it_reached() -> None:
    timings = RunTimings(started=START)
    timings.from_event({"event": "listening", "at": START + 2.0})
    timings.mark("processes_exited", START + 3.0)

    summary = timings.to_summary()

    assert summary["stages"] == {"server_listening": 2.0, "processes_exited": 3.0}
    assert summary["outside_rounds_s"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    "event",
    [
        pytest.param({"event": "listening", "at": "soon"}, id="at-not-a-number"),
        pytest.param({"event": "listening", "at": True}, id="at-a-bool"),
        pytest.param({"event": "listening"}, id="no-at"),
    ],
)
def test_an_event_without_a_usable_time_counts_as_now(event: dict[str, object]) -> None:
    timings = RunTimings(started=START)

    timings.from_event(event)

    assert timings.seconds()["server_listening"] > 1e6  # now, long after START


def test_an_unknown_stage_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown run stage 'lunch'; expected one of launcher_ready"):
        RunTimings().mark("lunch")


def test_the_timing_block_lists_each_stage_with_its_step_and_the_time_outside_rounds() -> None:
    timings = {"stages": {"launcher_ready": 1.25, "server_listening": 1.5}, "outside_rounds_s": 1.5}

    lines = timing_lines(timings)

    assert lines[0].startswith("timing (seconds since the run started")
    assert lines[1].split()[:3] == ["launcher_ready", "1.25", "(+1.25)"]
    assert lines[2].split()[:3] == ["server_listening", "1.50", "(+0.25)"]
    assert lines[3].split() == ["outside", "rounds", "1.50"]
    assert timing_lines({}) == []
