"""What a run leaves in ``<workspace>/summary.json``, gathered from the files its processes wrote.

The server writes its outcome to ``server/result.json`` (state, reason, rounds, warnings, the
deaths and returns of sites), each
process its figures to ``<site>/process.json`` (peak RSS), each client its events to
``<site>/events.jsonl`` (``client_ready``: when it had built its executors), and a cross-site
evaluation workflow its matrix to ``server/cross_site_val.json``. The simulator adds what it saw
itself: states, warnings, exit codes and the time of each stage (`engine.runtime.timings`); the
server daemon of a deployed project what its job store knows (`engine.deploy.job_summary`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from engine.runtime.process import EVENTS_FILE, PROCESS_FILE, RESULT_FILE
from engine.runtime.progress import refused_counts
from engine.runtime.states import JobState

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
#: The cross-site evaluation matrix a workflow may leave in the server's folder.
CROSS_SITE_FILE = "cross_site_val.json"


def server_result(workspace: Path) -> tuple[JobState | None, str]:
    """The server's final state and reason from its ``result.json``; (None, "") when there is none."""
    try:
        record = json.loads((workspace / "server" / RESULT_FILE).read_text(encoding="utf-8"))
        return JobState(record["state"]), str(record.get("reason", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None, ""


def client_ready_times(workspace: Path, clients: list[str]) -> dict[str, float]:
    """When each client had built its executors: the ``at`` of its first ``client_ready`` event."""
    times = {}
    for site in clients:
        try:
            with (workspace / site / EVENTS_FILE).open("rb") as stream:
                for raw in stream:
                    event = json.loads(raw)
                    if isinstance(event, dict) and event.get("event") == "client_ready":
                        times[site] = float(event["at"])
                        break
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return times


def write_summary(
    workspace: Path, fields: dict[str, Any], exit_codes: dict[str, int | None], server: str = "server"
) -> dict[str, Any]:
    """Write ``summary.json``: ``fields`` (the caller's), then the rounds, processes and matrix the files hold.

    The simulator calls it at the end of a run; the server daemon of a deployed project for each
    job it hands out (`engine.deploy.job_summary`). The file is replaced whole (a temporary file
    renamed), so a reader never sees half of it.

    Args:
        workspace: The run's workspace.
        fields: What the caller knows (job, status, states, ``warnings``, ``timings`` ...), in
            the order they are written; the server's warnings are appended to ``warnings``.
        exit_codes: Each process's exit code (None: it did not exit, or it is not known).
        server: The name of the server process's folder in ``workspace`` (its site name).

    Returns:
        The summary as written.
    """
    rounds: list[dict[str, Any]] = []
    server_warnings: list[str] = []
    site_events: list[dict[str, Any]] = []
    try:
        record = json.loads((workspace / server / RESULT_FILE).read_text(encoding="utf-8"))
        rounds = record.get("rounds", [])
        server_warnings = [str(line) for line in record.get("warnings") or []]
        site_events = [event for event in record.get("site_events") or [] if isinstance(event, dict)]
    except (OSError, ValueError, AttributeError):
        pass
    processes = {}
    for site, code in exit_codes.items():
        entry: dict[str, Any] = {"exit_code": code}
        try:
            figures = json.loads((workspace / site / PROCESS_FILE).read_text(encoding="utf-8"))
            entry["peak_rss_mb"] = round(figures["peak_rss_bytes"] / 2**20, 1)
        except (OSError, ValueError, KeyError, TypeError):
            entry["peak_rss_mb"] = None
        processes[site] = entry
    timings = fields.pop("timings", None)
    summary = {
        **fields,
        "rounds": rounds,
        "refused": refused_counts(rounds),
        "warnings": [*fields.get("warnings", []), *server_warnings],
        "processes": processes,
    }
    if site_events:  # sites that died and came back during the run, in order
        summary["site_events"] = site_events
    if timings is not None:
        summary["timings"] = timings
    matrix_file = workspace / server / CROSS_SITE_FILE
    if matrix_file.is_file():
        try:
            summary["cross_site_val"] = json.loads(matrix_file.read_text(encoding="utf-8"))
        except ValueError:
            log.warning("unreadable cross-site evaluation file: %s", matrix_file)
    path = workspace / SUMMARY_FILE
    temporary = path.with_name(f".{SUMMARY_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        temporary.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return summary
