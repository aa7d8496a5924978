"""``flengine report``: one self-contained HTML page about a finished run, from its workspace.

The page shows the run's status and processes, the global metrics per round (summary.json),
each site's metrics per round (its metrics.jsonl), each round's time split into sending,
training, receiving and aggregating and a timeline of what each site did when (the events),
every transfer's bytes and MiB/s, each process's memory over time (its rss.csv) and the
cross-site evaluation matrix as a heat map. What a workspace lacks is listed on the page
("Not shown"), never a traceback. Plots need matplotlib, the ``report`` extra
(``pip install flengine[report]``), imported only here.

Example:
    >>> from engine.report import write_report
    >>> report = write_report("workspace/fedavg-20260101-120000")
    >>> report.path, [section.id for section in report.sections]
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import UsageError
from engine.report import figures
from engine.report.figures import Section, load_matplotlib
from engine.report.page import render
from engine.report.timeline import build_timeline
from engine.report.workspace import read_workspace

__all__ = ["REPORT_FILE", "Report", "Section", "build_report", "write_report"]

#: The report's default name, in the workspace.
REPORT_FILE = "report.html"


@dataclass
class Report:
    """A report made: its page, its sections, and what the workspace lacked."""

    html: str
    sections: list[Section] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    path: Path | None = None

    def to_json(self) -> dict[str, Any]:
        """What ``flengine report --format json`` prints: the file, each section's series and notes."""
        return {
            "report": str(self.path) if self.path else None,
            "sections": [
                {"id": s.id, "title": s.title, "series": s.series, "plotted": s.png is not None, "note": s.note}
                for s in self.sections
            ],
            "notes": self.notes,
        }


def build_report(workspace: str | os.PathLike[str]) -> Report:
    """Read ``workspace`` and draw the report (nothing is written).

    Raises:
        UsageError: ``workspace`` is not a run's workspace, or matplotlib is missing.
    """
    load_matplotlib()  # before any reading: the clearer error first
    data = read_workspace(workspace)
    timeline = build_timeline(data)
    sites = [name for name in data.processes if name != "server"]
    sections = [
        figures.global_metrics(data.summary, data.server_metrics()),
        figures.client_metrics(data.site_metrics()),
        figures.round_times(timeline),
        figures.timeline_chart(timeline, sites),
        figures.transfers(timeline),
        figures.memory(data.processes, timeline.origin),
        figures.cross_site(data.summary),
    ]
    return Report(render(data, sections), sections, list(data.notes))


def write_report(workspace: str | os.PathLike[str], output: str | os.PathLike[str] | None = None) -> Report:
    """Draw the report of ``workspace`` and write it to ``output`` (default ``<workspace>/report.html``).

    The file is written whole or not at all (a temporary file renamed).

    Raises:
        UsageError: As `build_report`, or ``output`` cannot be written.
    """
    path = Path(output) if output is not None else Path(workspace) / REPORT_FILE
    if output is not None and not path.parent.is_dir():  # said before a second goes into drawing
        raise UsageError(f"{path}: cannot write the report (no folder {path.parent}); choose another file with -o")
    report = build_report(workspace)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(report.html, encoding="utf-8")
        os.replace(temporary, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise UsageError(f"{path}: cannot write the report ({e.strerror}); choose another file with -o") from e
    report.path = path.resolve()
    return report
