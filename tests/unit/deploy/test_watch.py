"""`flengine admin watch` and `logs --follow` as an admin reads them: `JobView` driven with answers,
then `watch_job` and `follow_log` against a real server daemon (events and logs written by hand,
the job's record changed in the store as its process would)."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.deploy.admin import AdminError, AdminSession
from engine.deploy.server import ServerDaemon
from engine.deploy.watch import JobView, follow_log, watch_job
from engine.provision import load_kit
from tests.unit.deploy.test_commands import Server, answer, daemon, fedavg_zip, server, submit  # noqa: F401

JOB = "3f9c0a1b2c4d"


def watch_answer(status: str = "RUNNING", events: list[dict[str, Any]] | None = None, **job: Any) -> dict[str, Any]:
    record = {"job_id": JOB, "name": "fedavg", "submitter": "alice", "status": status, "sites": ["site-1", "site-2"]}
    sites = {"site-1": {"connected": True}, "site-2": {"connected": True}}
    return {"job": {**record, **job}, "events": events or [], "offset": 0, "more": False, "sites": sites}


ROUND_1 = [
    {"event": "round_started", "round": 1, "total_rounds": 2, "clients": ["site-1", "site-2"]},
    {"event": "task_sent", "site": "site-1", "task": "train", "round": 1},
    {"event": "task_sent", "site": "site-2", "task": "train", "round": 1},
    {"event": "result_received", "site": "site-1", "task": "train", "bytes": 2 << 20, "seconds": 0.5, "ok": True},
    {"event": "result_received", "site": "site-2", "task": "train", "bytes": 0, "seconds": 0.1, "ok": False},
    {"event": "round_done", "round": 1, "time_s": 1.5, "metrics": {"acc": 0.5}, "clients": ["site-1"]},
]


def test_a_view_shows_the_job_then_each_step_of_its_rounds() -> None:
    view = JobView(JOB)

    first = view.apply(watch_answer("SUBMITTED", sites=[], waiting="waiting for site-2 to connect"))
    running = view.apply(watch_answer("RUNNING", ROUND_1))

    assert first == [f"job {JOB} (fedavg) of alice: SUBMITTED; waiting for site-2 to connect"]
    assert running == [
        f"job {JOB}: RUNNING on site-1, site-2",
        "[round 1/2] sending the model to site-1, site-2",
        "[round 1/2] site-1: train started",
        "[round 1/2] site-2: train started",
        "[round 1/2] site-1: result received (2.0 MiB in 0.50 s, 4 MiB/s)",
        "[round 1/2] site-2: result failed",
        "[round 1/2] done in 1.50 s, 1 result: acc=0.5000",
    ]
    assert (view.round, view.total_rounds, view.metrics, view.metrics_round) == (1, 2, {"acc": 0.5}, 1)


def test_each_site_has_its_state_and_last_result() -> None:
    view = JobView(JOB)
    view.apply(watch_answer("RUNNING", ROUND_1))

    lines = view.apply(
        watch_answer(
            "RUNNING",
            [
                {"event": "round_started", "round": 2, "total_rounds": 2, "clients": ["site-1"]},
                {"event": "task_sent", "site": "site-1", "task": "train", "round": 2},
                {"event": "client_dead", "site": "site-2", "reason": "its job process exited with code 1"},
            ],
        )
        | {"sites": {"site-1": {"connected": True}, "site-2": {"connected": False}}}
    )

    assert lines[0] == "site-2: not connected (no status reports)"
    assert lines[-1].startswith("[round 2/2] site-2: dead (its job process exited with code 1)")
    assert view.snapshot()["sites"] == {
        "site-1": {"state": "working", "task": "train", "last_result": "round 1: ok (2.0 MiB in 0.50 s)",
                   "connected": True, "detail": ""},
        "site-2": {"state": "dead", "task": "train", "last_result": "round 1: failed", "connected": False,
                   "detail": "its job process exited with code 1"},
    }  # fmt: skip


def test_the_end_is_a_table_of_the_sites_the_last_metrics_and_the_final_state() -> None:
    view = JobView(JOB)
    view.apply(watch_answer("RUNNING", ROUND_1))

    last = view.apply(watch_answer("FINISHED_EXECUTION_EXCEPTION", reason="site-2: RuntimeError: injected"))

    assert last == []  # the final state is the summary's last line, not a line of its own
    assert view.final
    assert view.summary_lines() == [
        "site    state    daemon         last result",
        "site-1  idle     connected      round 1: ok (2.0 MiB in 0.50 s)",
        "site-2  idle     connected      round 1: failed",
        "metrics of round 1: acc=0.5000",
        f"job {JOB}: FINISHED_EXECUTION_EXCEPTION (site-2: RuntimeError: injected)",
    ]


def test_events_a_watcher_does_not_need_and_malformed_ones_show_nothing() -> None:
    view = JobView(JOB)

    lines = view.apply(
        watch_answer(
            "RUNNING",
            [
                {"event": "listening", "endpoint": "tcp://0.0.0.0:8003"},
                {"event": "download_progress", "site": "site-1", "bytes": 10},
                {"event": "task_sent"},  # no site, no task
                {"event": "round_done", "round": "one", "metrics": "lots"},
            ],
        )
    )

    assert lines == [f"job {JOB} (fedavg) of alice: RUNNING on site-1, site-2"]
    assert [event["event"] for event in view.new_events] == ["task_sent", "round_done"]


@pytest.mark.parametrize(
    "bad",
    [None, [], {"job": {}}, {"job": {}, "events": [], "sites": {}, "offset": "0"}, {"lines": []}],
    ids=["null", "list", "no-events", "offset-not-int", "a-logs-answer"],
)
def test_an_answer_that_is_not_a_watch_answer_is_an_admin_error(bad: Any) -> None:
    with pytest.raises(AdminError, match=r"^watch: the server's answer is not a watch answer"):
        JobView(JOB).apply(bad)


# ----------------------------------------------------------------- against a server daemon


@pytest.fixture
def session(server: Server) -> Iterator[AdminSession]:  # noqa: F811
    with AdminSession(load_kit(server.kits / "alice")) as opened:
        yield opened


@pytest.fixture
def job_id(server: Server, fedavg_zip: Path) -> str:  # noqa: F811
    return answer(submit(server.admin("alice"), fedavg_zip))["job_id"]


def server_folder(daemon: ServerDaemon, job_id: str) -> Path:  # noqa: F811
    folder = daemon.store.workspace(job_id) / "server"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def running_on_site_1(daemon: ServerDaemon, job_id: str, event: dict[str, Any]) -> Path:  # noqa: F811
    """The job RUNNING on site-1, its server's events holding ``event``; the events file."""
    events = server_folder(daemon, job_id) / "events.jsonl"
    daemon.store.update(job_id, status="RUNNING", sites=["site-1"])
    events.write_text(json.dumps(event) + "\n")
    return events


def later(seconds: float, action: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def test_watch_follows_the_job_until_it_ends_and_exits_0_when_it_completed(
    daemon: ServerDaemon,  # noqa: F811
    session: AdminSession,
    job_id: str,
) -> None:
    started = {"event": "round_started", "round": 1, "total_rounds": 1, "clients": ["site-1"]}
    events = running_on_site_1(daemon, job_id, started)

    def job_ends() -> None:
        with events.open("a") as out:
            out.write(json.dumps({"event": "round_done", "round": 1, "time_s": 0.2, "metrics": {"acc": 0.75}}) + "\n")
        daemon.store.update(job_id, status="FINISHED_COMPLETED")

    out = io.StringIO()
    ending = later(0.3, job_ends)
    code = watch_job(session, job_id, "text", out=out, interval_s=0.05)
    ending.join()

    lines = out.getvalue().splitlines()
    assert code == 0
    assert lines[0] == f"job {job_id} (fedavg) of alice: RUNNING on site-1"
    assert "[round 1/1] sending the model to site-1" in lines
    assert "[round 1/1] done in 0.20 s, 0 results: acc=0.7500" in lines
    assert lines[-2:] == ["metrics of round 1: acc=0.7500", f"job {job_id}: FINISHED_COMPLETED"]


def test_watch_json_is_one_object_per_update_and_exits_1_for_a_job_that_did_not_complete(
    daemon: ServerDaemon,  # noqa: F811
    session: AdminSession,
    job_id: str,
) -> None:
    events = server_folder(daemon, job_id) / "events.jsonl"
    events.write_text(json.dumps({"event": "workflow_note", "message": "\x1b[2Jcleared"}) + "\n")
    daemon.store.update(job_id, status="FINISHED_ABORTED", reason="abort command by olga")
    out = io.StringIO()

    code = watch_job(session, job_id, "json", out=out, interval_s=0.05)

    [update] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == 1
    assert (update["status"], update["reason"], update["final"]) == ("FINISHED_ABORTED", "abort command by olga", True)
    assert update["events"][0]["message"] == "\x1b[2Jcleared"  # JSON escapes it itself


def test_watch_json_ends_with_a_final_line_when_the_state_changes_after_the_last_event(
    daemon: ServerDaemon,  # noqa: F811
    session: AdminSession,
    job_id: str,
) -> None:
    running_on_site_1(daemon, job_id, {"event": "round_started", "round": 1, "total_rounds": 1})
    out = io.StringIO()
    # the job's record changes well after its last event was read: that answer brings no event
    ending = later(0.5, lambda: daemon.store.update(job_id, status="FINISHED_EXECUTION_EXCEPTION", reason="boom"))

    code = watch_job(session, job_id, "json", out=out, interval_s=0.05)
    ending.join()

    updates = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == 1
    assert [update["final"] for update in updates] == [False] * (len(updates) - 1) + [True]
    assert (updates[-1]["status"], updates[-1]["reason"]) == ("FINISHED_EXECUTION_EXCEPTION", "boom")


def test_watch_text_escapes_what_the_job_wrote(
    daemon: ServerDaemon,  # noqa: F811
    session: AdminSession,
    job_id: str,
) -> None:
    events = server_folder(daemon, job_id) / "events.jsonl"
    events.write_text(json.dumps({"event": "round_done", "round": 1, "metrics": {"\x1b]0;pwned\x07": 1}}) + "\n")
    daemon.store.update(job_id, status="FINISHED_COMPLETED")
    out = io.StringIO()

    watch_job(session, job_id, "text", out=out, interval_s=0.05)

    assert "\x1b" not in out.getvalue() and "\\x1b]0;pwned\\x07=1" in out.getvalue()


def test_watch_json_of_an_unknown_job_ends_with_one_error_line(
    session: AdminSession, capsys: pytest.CaptureFixture[str]
) -> None:
    out = io.StringIO()

    code = watch_job(session, "0123456789ab", "json", out=out, interval_s=0.05)

    assert code == 1
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [
        {"error": "no job 0123456789ab", "exit_code": 1}
    ]
    assert capsys.readouterr().err == "Error: no job 0123456789ab\n"


def test_logs_follow_prints_the_last_lines_then_each_new_one_until_the_job_ended(
    daemon: ServerDaemon,  # noqa: F811
    session: AdminSession,
    job_id: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log_file = server_folder(daemon, job_id) / "log.txt"
    log_file.write_text("started\n")

    def more_then_end() -> None:
        with log_file.open("a") as out:
            out.write("round 1 \x1b[31mdone\n")
        time.sleep(0.2)
        daemon.store.update(job_id, status="FINISHED_EXECUTION_EXCEPTION", reason="site-1 failed")

    out = io.StringIO()
    ending = later(0.2, more_then_end)
    code = follow_log(session, job_id, "", "text", out=out, interval_s=0.05)
    ending.join()

    assert code == 1
    assert out.getvalue().splitlines() == ["started", "round 1 \\x1b[31mdone"]
    assert capsys.readouterr().err == f"job {job_id}: FINISHED_EXECUTION_EXCEPTION (site-1 failed)\n"
