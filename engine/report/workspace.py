"""Reading a finished run's workspace for the report: every file is optional, none is trusted.

What a run leaves (see ``engine.runtime``): ``summary.json``; per process folder (``server``,
``site-1`` ...) ``events.jsonl``, ``metrics.jsonl``, ``rss.csv`` and ``process.json``. A missing
or unreadable file, a line that is not JSON, a value that is not a finite number: each is
skipped and counted in `RunData.notes`, so the report says what it could not show instead of
failing. Files are read up to `MAX_FILE_BYTES`; folders and files that are symbolic links are
not followed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import UsageError
from engine.runtime.process import EVENTS_FILE, PROCESS_FILE
from engine.runtime.rss import RSS_FILE

#: Names the simulator (``engine.runtime.simulator.SUMMARY_FILE``) and the Client API executor
#: (its metrics file) write; not imported from there, which would load torch for a report.
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
#: The most bytes read of any one file (the rest is left out, and a note says so).
MAX_FILE_BYTES = 64 << 20
#: Process folders looked at, at most (a workspace is a run's, with one folder per process).
MAX_PROCESSES = 256
_KNOWN_FILES = (EVENTS_FILE, METRICS_FILE, RSS_FILE, PROCESS_FILE)


@dataclass
class Metric:
    """One client metric: ``value`` of ``key`` that ``site`` logged in 1-based ``round``."""

    site: str
    key: str
    round: int
    value: float


@dataclass
class ProcessData:
    """What one process folder holds."""

    name: str
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (unix seconds, bytes)
    figures: dict[str, Any] = field(default_factory=dict)  # process.json


@dataclass
class RunData:
    """A workspace's contents as far as they could be read, and notes on what could not."""

    folder: Path
    summary: dict[str, Any] = field(default_factory=dict)
    processes: dict[str, ProcessData] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def server(self) -> ProcessData | None:
        """The server's folder, if there is one."""
        return self.processes.get("server")

    def site_metrics(self) -> list[Metric]:
        """The sites' metrics: the server's metrics.jsonl for each site it has, else the site's own file.

        The server's file is the one a production run keeps in one place; a site's own file
        (which also keeps what the server refused) stands in for a site the server has none of.
        """
        server = [m for m in self.server.metrics if m.site != "server"] if self.server else []
        covered = {m.site for m in server}
        own = [m for name, p in self.processes.items() if name != "server" for m in p.metrics if m.site not in covered]
        return server + own

    def server_metrics(self) -> list[Metric]:
        """The global metrics the server wrote to its metrics.jsonl (site ``server``)."""
        return [m for m in self.server.metrics if m.site == "server"] if self.server else []


def finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (a bool, a string, inf, nan, an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def read_workspace(folder: str | Path) -> RunData:
    """Read what a run left in ``folder``.

    Raises:
        UsageError: ``folder`` is not a folder, or holds neither ``summary.json`` nor any process
            folder (it is not a run's workspace).
    """
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"{root}: not a folder; give the workspace `flengine run` printed")
    data = RunData(root.resolve())
    data.summary = _read_summary(root / SUMMARY_FILE, data.notes)
    for sub in _process_folders(root, data.notes):
        data.processes[sub.name] = _read_process(sub, data.notes)
    if not data.summary and not data.processes:
        raise UsageError(
            f"{root}: not a run's workspace: no {SUMMARY_FILE} and no process folder (server, site-1 ...) "
            f"with {', '.join(_KNOWN_FILES)}"
        )
    return data


def _read_summary(path: Path, notes: list[str]) -> dict[str, Any]:
    if path.is_symlink() or not path.is_file():
        notes.append(f"{SUMMARY_FILE} is missing: no status, global metrics or cross-site evaluation")
        return {}
    text = _read_text(path, notes)
    try:
        summary = json.loads(text)
    except ValueError as e:
        notes.append(f"{SUMMARY_FILE} is not valid JSON ({e}): no status, global metrics or cross-site evaluation")
        return {}
    if not isinstance(summary, dict):
        notes.append(f"{SUMMARY_FILE} is not a JSON object: ignored")
        return {}
    return summary


def _process_folders(root: Path, notes: list[str]) -> list[Path]:
    found = []
    for entry in root.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue
        if any((entry / name).is_file() for name in _KNOWN_FILES):
            found.append(entry)
    found.sort(key=lambda path: process_order(path.name))
    if len(found) > MAX_PROCESSES:
        notes.append(f"{len(found)} process folders: only the first {MAX_PROCESSES} are shown")
        found = found[:MAX_PROCESSES]
    return found


def process_order(name: str) -> tuple[int, str, int]:
    """Sort key of process names: the server first, then sites by their number (site-2 before site-10)."""
    match = re.fullmatch(r"(.*?)(\d+)", name)
    if match:
        return (name != "server", match.group(1), int(match.group(2)))
    return (name != "server", name, -1)


def _read_process(folder: Path, notes: list[str]) -> ProcessData:
    process = ProcessData(folder.name)
    name = folder.name
    process.events = [line for line in _json_lines(folder / EVENTS_FILE, notes, name) if _is_event(line)]
    for line in _json_lines(folder / METRICS_FILE, notes, name):
        metric = _metric(line, name)
        if metric is not None:
            process.metrics.append(metric)
    process.rss = _rss(folder / RSS_FILE, notes, name)
    figures = folder / PROCESS_FILE
    if figures.is_file() and not figures.is_symlink():
        try:
            loaded = json.loads(_read_text(figures, notes))
            process.figures = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            notes.append(f"{name}/{PROCESS_FILE} is not valid JSON: ignored")
    return process


def _is_event(line: Any) -> bool:
    return isinstance(line, dict) and isinstance(line.get("event"), str) and finite(line.get("at")) is not None


def _metric(line: Any, folder: str) -> Metric | None:
    """A metrics.jsonl line (``round`` 1-based, as both the sites and the server write it) as a `Metric`.

    None when it is not one: no numeric finite value, no key, no round.
    """
    if not isinstance(line, dict):
        return None
    value, number = finite(line.get("value")), line.get("round")
    if value is None or not isinstance(line.get("key"), str) or type(number) is not int or number < 1:
        return None
    site = line.get("site") if isinstance(line.get("site"), str) else folder
    return Metric(site, line["key"], number, value)


def _read_text(path: Path, notes: list[str]) -> str:
    try:
        with path.open("rb") as stream:
            raw = stream.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        notes.append(f"{path.name}: cannot be read ({e.strerror})")
        return ""
    if len(raw) > MAX_FILE_BYTES:
        notes.append(f"{path.parent.name}/{path.name} is over {MAX_FILE_BYTES >> 20} MiB: only its start is read")
        raw = raw[:MAX_FILE_BYTES]
    return raw.decode("utf-8", errors="replace")


def _json_lines(path: Path, notes: list[str], folder: str) -> list[Any]:
    if path.is_symlink() or not path.is_file():
        return []
    lines, bad = [], 0
    for text in _read_text(path, notes).splitlines():
        if not text.strip():
            continue
        try:
            lines.append(json.loads(text))
        except ValueError:
            bad += 1
    if bad:
        notes.append(f"{folder}/{path.name}: {bad} line{'s' if bad != 1 else ''} not valid JSON, skipped")
    return lines


def _rss(path: Path, notes: list[str], folder: str) -> list[tuple[float, float]]:
    if path.is_symlink() or not path.is_file():
        return []
    samples, bad = [], 0
    for text in _read_text(path, notes).splitlines()[1:]:
        parts = text.split(",")
        try:
            when, rss = float(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            bad += 1
            continue
        if len(parts) == 2 and math.isfinite(when) and math.isfinite(rss) and rss >= 0:
            samples.append((when, rss))
        else:
            bad += 1
    if bad:
        notes.append(f"{folder}/{path.name}: {bad} line{'s' if bad != 1 else ''} not a sample, skipped")
    return samples
