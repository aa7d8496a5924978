"""A deployed job's ``summary.json`` (`write_job_summary`): the simulator's schema from the job store's
record and the job workspace (the downloads that bring it: tests/unit/deploy/test_commands.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.deploy.job_store import JobRecord, StoreStatus
from engine.deploy.job_summary import job_states, write_job_summary
from engine.report.page import render
from engine.report.workspace import read_workspace
from engine.runtime.summary import SUMMARY_FILE

JOB_ID = "0123456789ab"
SUBMITTED, STARTED, FINISHED = "2025-01-31T12:00:00+00:00", "2025-01-31T12:00:02+00:00", "2025-01-31T12:01:03.5+00:00"


def record(**changes: object) -> JobRecord:
    fields: dict[str, object] = {
        "job_id": JOB_ID,
        "name": "fedavg",
        "submitter": "alice",
        "submitter_org": "a",
        "status": StoreStatus.FINISHED_COMPLETED,
        "submitted_at": SUBMITTED,
        "started_at": STARTED,
        "finished_at": FINISHED,
        "sites": ["site-1", "site-2"],
        "exit_codes": {"lab": 0, "site-1": 0, "site-2": -9},
        "states": [
            {"state": "SUBMITTED", "time": SUBMITTED},
            {"state": "RUNNING", "time": STARTED},
            {"state": "FINISHED_COMPLETED", "time": FINISHED},
        ],
    }
    return JobRecord(**{**fields, **changes})  # type: ignore[arg-type]


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_the_summary_holds_the_records_states_and_exits_and_what_the_workspace_holds(tmp_path: Path) -> None:
    rounds = [{"round": 1, "metrics": {"accuracy": 0.5}, "refused": {"site-2": "ValueError: NaN"}}]
    write_json(
        tmp_path / "lab" / "result.json",  # the server's folder is named after its identity
        {"state": "FINISHED_COMPLETED", "rounds": rounds, "warnings": ["persistor: a warning"], "site_events": []},
    )
    write_json(tmp_path / "lab" / "process.json", {"peak_rss_bytes": 300 * 2**20})
    write_json(tmp_path / "site-1" / "process.json", {"peak_rss_bytes": 200 * 2**20})
    (tmp_path / "lab" / "cross_site_val.json").write_text('{"site-1": {"global": {"accuracy": 0.9}}}')

    summary = write_job_summary(record(), tmp_path, "lab")

    assert json.loads((tmp_path / SUMMARY_FILE).read_text()) == summary
    assert (summary["job"], summary["job_id"], summary["status"], summary["reason"]) == (
        "fedavg",
        JOB_ID,
        "FINISHED_COMPLETED",
        "",
    )
    assert [entry["state"] for entry in summary["states"]] == ["SUBMITTED", "RUNNING", "FINISHED_COMPLETED"]
    assert summary["seconds"] == 61.5 and summary["clients"] == ["site-1", "site-2"]
    assert summary["rounds"] == rounds and summary["refused"] == {"site-2": 1}
    assert summary["warnings"] == [
        "site-2 handed in no results: its memory, metrics and log are not here",
        "persistor: a warning",
    ]
    assert summary["processes"] == {
        "lab": {"exit_code": 0, "peak_rss_mb": 300.0},
        "site-1": {"exit_code": 0, "peak_rss_mb": 200.0},
        "site-2": {"exit_code": -9, "peak_rss_mb": None},
    }
    assert summary["cross_site_val"] == {"site-1": {"global": {"accuracy": 0.9}}}
    assert "workspace" not in summary and "timings" not in summary
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_report_of_a_summarised_job_shows_its_status_and_exit_codes(tmp_path: Path) -> None:
    write_json(tmp_path / "server" / "process.json", {"peak_rss_bytes": 300 * 2**20})
    write_job_summary(record(exit_codes={"server": 0, "site-1": 0, "site-2": 0}), tmp_path, "server")

    page = render(read_workspace(tmp_path), [])

    assert "unknown" not in page
    assert '<th>status</th><td><span class="ok">FINISHED_COMPLETED</span>' in page
    assert "<tr><td>server</td><td>0</td><td>300.0</td>" in page


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"status": "SUBMITTED", "started_at": None, "finished_at": None}, [("SUBMITTED", SUBMITTED)]),
        ({"status": "RUNNING", "finished_at": None}, [("SUBMITTED", SUBMITTED), ("RUNNING", STARTED)]),
        (
            {"status": "FINISHED_ABORTED", "finished_at": None},
            [("SUBMITTED", SUBMITTED), ("RUNNING", STARTED), ("FINISHED_ABORTED", None)],
        ),
        (
            {"status": "FINISHED_REJECTED", "started_at": None},
            [("SUBMITTED", SUBMITTED), ("FINISHED_REJECTED", FINISHED)],
        ),
    ],
    ids=["queued", "running", "lost-by-the-server", "rejected"],
)
def test_a_record_that_kept_no_states_has_them_made_from_its_times(
    changes: dict[str, object], expected: list[tuple[str, str | None]]
) -> None:
    states = job_states(record(states=[], **changes))

    assert [(entry["state"], entry["time"]) for entry in states] == expected


def test_the_run_time_is_left_out_where_it_is_not_known(tmp_path: Path) -> None:
    summary = write_job_summary(record(status="FINISHED_ABORTED", finished_at=None), tmp_path, "server")

    assert "seconds" not in summary
