"""A deployed job's ``summary.json``: the simulator's schema, written by the server daemon into the job's workspace.

The simulator writes ``summary.json`` at the end of a run from what it saw. In a deployed
project the server daemon knows the same things another way: its job store's record (each
status with its time, the sites, how each job process exited, as the sites report it) and the
job workspace, which holds the server job process's ``result.json`` (rounds, refusals, site
events) and each site's results (its ``process.json`` with its peak memory). `write_job_summary`
hands these to `engine.runtime.summary.write_summary`, the schema's one home, so ``flengine
report`` reads a downloaded job as it reads a simulator's workspace.

What differs from the simulator's: there is no ``workspace`` (the server's folders are not the
admin's to know) and no ``timings`` (the stages of a simulator's start-up); times are UTC.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from engine.deploy.job_store import JobRecord, StoreStatus
from engine.runtime.summary import write_summary

__all__ = ["job_states", "write_job_summary"]


def write_job_summary(record: JobRecord, workspace: Path, server: str) -> dict[str, Any]:
    """Write ``workspace/summary.json`` for the job of ``record``; return the summary written.

    Args:
        record: The job's record, as the store has it now.
        workspace: The job's workspace (the server's folder and each site's results in it).
        server: The server's identity: its job process's folder in ``workspace``.

    Raises:
        OSError: The file cannot be written.
    """
    fields: dict[str, Any] = {
        "job": record.name,
        "job_id": record.job_id,
        "status": record.status,
        "reason": record.reason,
        "states": job_states(record),
        "clients": list(record.sites),
    }
    seconds = _seconds_between(record.started_at, record.finished_at)
    if seconds is not None:
        fields["seconds"] = seconds
    fields["warnings"] = [
        f"{site} handed in no results: its memory, metrics and log are not here"
        for site in record.sites
        if record.is_final and not (workspace / site).is_dir()
    ]
    exit_codes = {name: record.exit_codes.get(name) for name in (server, *record.sites)}
    return write_summary(workspace, fields, exit_codes, server=server)


def job_states(record: JobRecord) -> list[dict[str, str | None]]:
    """Every status of the job with its time, in order; made from the record's times where it keeps no list.

    A record written before the store kept each status has its submit, start and end times:
    those make the list (an end whose time is not known has None).
    """
    if record.states:
        return [dict(entry) for entry in record.states]
    states: list[dict[str, str | None]] = [{"state": StoreStatus.SUBMITTED.value, "time": record.submitted_at}]
    if record.started_at:
        states.append({"state": StoreStatus.RUNNING.value, "time": record.started_at})
    if record.is_final:
        states.append({"state": record.status, "time": record.finished_at})
    return states


def _seconds_between(start: str | None, end: str | None) -> float | None:
    """Seconds from ``start`` to ``end`` (ISO-8601 times), or None when either is missing or unreadable."""
    try:
        seconds = (datetime.fromisoformat(end or "") - datetime.fromisoformat(start or "")).total_seconds()
    except (ValueError, TypeError):  # missing, unreadable, or one with a zone and one without
        return None
    return round(seconds, 2) if seconds >= 0 else None
