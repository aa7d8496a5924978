"""What a deployed job's download must hold: a ``summary.json`` of the simulator's schema, written by the
server daemon (issue 36): states with times, rounds, refusals, each job process's exit code and peak memory;
and ``flengine report`` of the download shows the job's status, not "unknown"."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from engine.report import build_report


def assert_downloaded_summary(folder: Path, job_id: str, sites: tuple[str, ...]) -> None:
    """Check the summary and the report of the two-round bench job downloaded into ``folder``."""
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["job"], summary["job_id"], summary["status"]) == ("bench", job_id, "FINISHED_COMPLETED")
    assert [entry["state"] for entry in summary["states"]] == ["SUBMITTED", "RUNNING", "FINISHED_COMPLETED"]
    times = [datetime.fromisoformat(entry["time"]) for entry in summary["states"]]
    assert times == sorted(times)
    assert summary["seconds"] == round((times[-1] - times[1]).total_seconds(), 2)
    assert sorted(summary["clients"]) == list(sites)
    assert [entry["round"] for entry in summary["rounds"]] == [1, 2]
    assert all(sorted(entry["clients"]) == list(sites) for entry in summary["rounds"])
    assert summary["refused"] == {}
    assert summary["warnings"] == [  # the server job process's own, as in a simulator's summary
        "persistor: key_metric 'accuracy' was never reported; reported metrics: none "
        "(no best_global.safetensors was written: set key_metric to one of them)"
    ]
    assert sorted(summary["processes"]) == ["server", *sites]
    for name, process in summary["processes"].items():
        assert process["exit_code"] == 0, name
        assert process["peak_rss_mb"] > 10, name  # each reported its own peak memory
    assert "workspace" not in summary  # the server's folders are not the admin's to know

    report = build_report(folder)

    assert "unknown" not in report.html
    assert re.search(r'<th>status</th><td><span class="ok">FINISHED_COMPLETED</span>', report.html)
    for name in ("server", *sites):  # exit code 0 and a peak memory in each process's row
        assert re.search(rf"<tr><td>{name}</td><td>0</td><td>\d+\.\d</td>", report.html), name
    assert not any("summary.json" in note for note in report.notes), report.notes
