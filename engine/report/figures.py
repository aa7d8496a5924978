"""The report's plots, drawn with matplotlib (the ``report`` extra) as PNG images.

Each function takes what it plots and returns a `Section`: its title, the series it drew with
their lengths (what a test checks), the PNG, an optional table, and a note where data is
missing. Text from the workspace (metric names, site names) is cut short and drawn as plain
text (no mathtext: a ``$`` in a metric name is a dollar sign).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from engine.errors import UsageError
from engine.report.timeline import PHASES, Timeline
from engine.report.workspace import Metric, ProcessData, finite, process_order
from engine.text import printable

#: Longest label drawn (metric, site and model names come from peers).
MAX_LABEL = 40
#: Most metric keys drawn (one panel each), and most lines in one panel.
MAX_PANELS = 8
MAX_SERIES = 24
#: Rows of the transfers table shown (the plot shows every transfer).
MAX_TABLE_ROWS = 100
#: Cross-site matrices up to this size get their values written in the cells.
MAX_ANNOTATED = 12
WIDTH_IN = 11.0
DPI = 100
PHASE_COLORS = {"sending": "#4c78a8", "training": "#59a14f", "receiving": "#f28e2b", "aggregating": "#e15759"}
SPAN_COLORS = {"download": "#4c78a8", "train": "#59a14f", "upload": "#f28e2b"}


@dataclass
class Section:
    """One part of the report."""

    id: str
    title: str
    series: dict[str, int] = field(default_factory=dict)  # label -> points drawn
    png: bytes | None = None
    note: str = ""
    table: list[list[str]] | None = None  # header row first


def load_matplotlib() -> Any:
    """Import matplotlib's Figure lazily; a clear error naming the extra when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError as e:
        raise UsageError(
            "flengine report draws its plots with matplotlib, which is not installed: pip install flengine[report]"
        ) from e
    return Figure


def label(text: Any) -> str:
    """``text`` safe to draw: printable, at most `MAX_LABEL` characters, not hidden from a legend."""
    text = printable(str(text), MAX_LABEL)
    return f" {text}" if text.startswith("_") else text


@contextmanager
def _plain_text() -> Iterator[None]:
    import matplotlib

    with matplotlib.rc_context({"text.parse_math": False, "font.size": 10, "axes.titlesize": 11}):
        yield


def _figure(rows: int = 1, cols: int = 1, height_in: float = 3.6) -> tuple[Any, Any]:
    figure_class = load_matplotlib()
    figure = figure_class(figsize=(WIDTH_IN, height_in * rows), dpi=DPI, layout="constrained")
    axes = figure.subplots(rows, cols, squeeze=False)
    return figure, axes


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _legend(axis: Any, count: int) -> None:
    if count:
        axis.legend(fontsize=8, loc="best", ncols=1 if count <= 8 else 2)


def global_metrics(summary: dict[str, Any], server_metrics: list[Metric]) -> Section:
    """The global metrics per round: summary.json's ``rounds``, else the server's own lines of its metrics.jsonl."""
    section = Section("global-metrics", "Global metrics per round")
    series: dict[str, list[tuple[int, float]]] = {}
    rounds = summary.get("rounds") if isinstance(summary.get("rounds"), list) else []
    for entry in rounds:
        if not isinstance(entry, dict) or type(entry.get("round")) is not int or entry["round"] < 1:
            continue  # rounds are 1-based in summary.json
        metrics = entry.get("metrics") if isinstance(entry.get("metrics"), dict) else {}
        for key, value in metrics.items():
            number = finite(value)
            if number is not None:
                series.setdefault(str(key), []).append((entry["round"], number))
    if not series:
        for metric in server_metrics:
            series.setdefault(metric.key, []).append((metric.round, metric.value))
    if not series:
        section.note = "no global metric: no finished round reported one (summary.json rounds)"
        return section
    section.png, section.series, section.note = _metric_panels(series, "round", "value")
    return section


def client_metrics(metrics: list[Metric]) -> Section:
    """Each site's metrics per round (see `RunData.site_metrics`), one panel per metric key, one line per site."""
    section = Section("client-metrics", "Client metrics per round and site")
    by_key: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for metric in metrics:
        by_key.setdefault(metric.key, {}).setdefault(metric.site, []).append((metric.round, metric.value))
    if not by_key:
        section.note = "no client metric: neither the server's nor a site's metrics.jsonl has one (flare.log)"
        return section
    keys = sorted(by_key)
    notes = []
    if len(keys) > MAX_PANELS:
        notes.append(f"{len(keys)} metric keys: the first {MAX_PANELS} are drawn")
        keys = keys[:MAX_PANELS]
    cols = 2 if len(keys) > 1 else 1
    rows = math.ceil(len(keys) / cols)
    with _plain_text():
        figure, axes = _figure(rows, cols, height_in=3.2)
        for index, key in enumerate(keys):
            axis = axes[index // cols][index % cols]
            sites = sorted(by_key[key].items(), key=lambda item: process_order(item[0]))[:MAX_SERIES]
            for site, points in sites:
                points.sort()
                axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=label(site))
                section.series[f"{key} / {site}"] = len(points)
            axis.set_title(label(key))
            axis.set_xlabel("round")
            axis.grid(alpha=0.3)
            axis.xaxis.get_major_locator().set_params(integer=True)
            _legend(axis, len(sites))
        for index in range(len(keys), rows * cols):
            axes[index // cols][index % cols].set_visible(False)
        section.png = _png(figure)
    section.note = "; ".join(notes)
    return section


def _metric_panels(series: dict[str, list[tuple[int, float]]], xlabel: str, ylabel: str) -> tuple[bytes, dict, str]:
    notes, drawn = [], {}
    keys = list(series)
    if len(keys) > MAX_SERIES:
        notes.append(f"{len(keys)} metrics: the first {MAX_SERIES} are drawn")
        keys = keys[:MAX_SERIES]
    with _plain_text():
        figure, axes = _figure()
        axis = axes[0][0]
        for key in keys:
            points = sorted(series[key])
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=label(key))
            drawn[key] = len(points)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.xaxis.get_major_locator().set_params(integer=True)
        _legend(axis, len(keys))
        png = _png(figure)
    return png, drawn, "; ".join(notes)


def round_times(timeline: Timeline) -> Section:
    """Each round's time as a stacked bar of its phases (sending, training, receiving, aggregating)."""
    section = Section("round-times", "Round time: sending, training, receiving, aggregating")
    rounds = timeline.rounds
    if not rounds:
        section.note = "no round timing: the server's events.jsonl has no round_started/round_done pair"
        return section
    split = [timing for timing in rounds if timing.phases]
    with _plain_text():
        figure, axes = _figure()
        axis = axes[0][0]
        numbers = list(range(len(rounds)))
        if split:
            bottom = [0.0] * len(rounds)
            for phase in PHASES:
                values = [timing.phases.get(phase, 0.0) for timing in rounds]
                axis.bar(numbers, values, bottom=bottom, color=PHASE_COLORS[phase], label=phase)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
                section.series[phase] = len(split)
            unsplit = [i for i, timing in enumerate(rounds) if not timing.phases]
            if unsplit:
                axis.bar(unsplit, [rounds[i].seconds for i in unsplit], color="#bab0ac", label="not split")
            figure.legend(fontsize=8, loc="outside upper right", ncols=5)
        else:
            axis.bar(numbers, [timing.seconds for timing in rounds], color="#bab0ac", label="round")
            section.series["round"] = len(rounds)
            section.note = (
                "the rounds are not split into phases: the server sent no tasks in them (the clients passed "
                "the model among themselves, as in Swarm), or the clients recorded no task events"
            )
        if len(rounds) <= 30:  # a short round's bar is too thin to read: its total is written on it
            totals = [timing.seconds for timing in rounds]
            axis.bar(numbers, totals, fill=False, linewidth=0)
            axis.bar_label(axis.containers[-1], labels=[f"{t:.2f} s" for t in totals], fontsize=8, padding=2)
            axis.margins(y=0.1)
        _round_ticks(axis, [timing.round for timing in rounds])
        axis.set_ylabel("seconds")
        axis.grid(axis="y", alpha=0.3)
        section.png = _png(figure)
    section.table = [["round", "total (s)", *PHASES]]
    for timing in rounds:
        phases = [f"{timing.phases[p]:.3f}" if timing.phases else "-" for p in PHASES]
        section.table.append([str(timing.round), f"{timing.seconds:.3f}", *phases])
    if len(section.table) > MAX_TABLE_ROWS + 1:
        section.table = section.table[: MAX_TABLE_ROWS + 1]
        section.note = (section.note + "; " if section.note else "") + f"the table shows the first {MAX_TABLE_ROWS}"
    return section


def _round_ticks(axis: Any, numbers: list[int]) -> None:
    step = max(1, math.ceil(len(numbers) / 25))
    positions = list(range(0, len(numbers), step))
    axis.set_xticks(positions, [str(numbers[i]) for i in positions])
    axis.set_xlabel("round")


def timeline_chart(timeline: Timeline, sites: list[str]) -> Section:
    """What each site did when: downloading the task, training, uploading the result."""
    section = Section("timeline", "Timeline: each site's downloads, training and uploads")
    spans = [span for span in timeline.spans if span.site in sites]
    if not spans or timeline.origin is None:
        section.note = "no timeline: the sites' events.jsonl have no task events"
        return section
    shown = sites[: MAX_SERIES * 2]
    with _plain_text():
        figure, axes = _figure(height_in=max(2.2, 0.45 * len(shown) + 1.2))
        axis = axes[0][0]
        for row, site in enumerate(shown):
            for kind, color in SPAN_COLORS.items():
                mine = [s for s in spans if s.site == site and s.kind == kind]
                bars = [(s.start - timeline.origin, max(s.seconds, 1e-3)) for s in mine]
                if bars:
                    axis.broken_barh(bars, (row - 0.35, 0.7), color=color)
                    section.series[f"{site} / {kind}"] = len(bars)
        for timing in timeline.rounds:
            axis.axvline(timing.end - timeline.origin, color="#999999", linewidth=0.6, linestyle=":")
        axis.set_yticks(range(len(shown)), [label(site) for site in shown])
        axis.invert_yaxis()
        axis.set_xlabel("seconds since the run started (dotted: a round ends)")
        handles = [_patch(color, kind) for kind, color in SPAN_COLORS.items()]
        figure.legend(handles=handles, fontsize=8, loc="outside upper right", ncols=3)
        axis.grid(axis="x", alpha=0.3)
        section.png = _png(figure)
    return section


def _plain_log_scale(axis: Any) -> None:
    """A log y axis labelled with plain numbers (its default labels are mathtext, which is off)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_yscale("log")
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.yaxis.set_minor_formatter(NullFormatter())


def _patch(color: str, name: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=color, label=name)


def transfers(timeline: Timeline) -> Section:
    """Every model moved: MiB/s over time, downloads and uploads; a table of bytes, seconds and speed."""
    section = Section("transfers", "Transfers: bytes moved and MiB/s")
    moved = timeline.transfers
    if not moved or timeline.origin is None:
        section.note = "no transfer: no event records a model sent or received with its size"
        return section
    with _plain_text():
        figure, axes = _figure()
        axis = axes[0][0]
        for direction, marker in (("download", "v"), ("upload", "^")):
            points = [(t.end - timeline.origin, t.mib_per_s) for t in moved if t.direction == direction]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                name = "download (server to client)" if direction == "download" else "upload (client to server)"
                axis.scatter([p[0] for p in points], [p[1] for p in points], marker=marker, label=name, s=24)
                section.series[direction] = len(points)
        axis.set_xlabel("seconds since the run started")
        axis.set_ylabel("MiB/s")
        rates = [t.mib_per_s for t in moved if t.mib_per_s]
        if rates and max(rates) > 100 * min(rates):  # speeds that differ by orders of magnitude
            _plain_log_scale(axis)
        else:
            axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        _legend(axis, len(section.series))
        section.png = _png(figure)
    total = sum(t.bytes for t in moved)
    section.note = f"{len(moved)} transfers, {total / 2**20:.2f} MiB in all"
    section.table = [["direction", "site", "task", "round", "MiB", "seconds", "MiB/s"]]
    for t in moved[:MAX_TABLE_ROWS]:
        rate = f"{t.mib_per_s:.1f}" if t.mib_per_s is not None else "-"
        round_text = str(t.round) if t.round is not None else "-"
        section.table.append(
            [t.direction, label(t.site), label(t.task), round_text, f"{t.bytes / 2**20:.3f}", f"{t.seconds:.4f}", rate]
        )
    if len(moved) > MAX_TABLE_ROWS:
        section.note += f"; the table shows the first {MAX_TABLE_ROWS}"
    return section


def memory(processes: dict[str, ProcessData], origin: float | None) -> Section:
    """Each process's RSS over time (its rss.csv), with the peak it recorded (process.json)."""
    section = Section("memory", "Memory: each process's resident set size (RSS)")
    sampled = {name: process for name, process in processes.items() if process.rss}
    if not sampled or origin is None:
        section.note = "no memory samples: no process folder has an rss.csv (sampled on Linux only)"
        return section
    with _plain_text():
        figure, axes = _figure()
        axis = axes[0][0]
        for name, process in list(sampled.items())[:MAX_SERIES]:
            samples = sorted(process.rss)
            peak = finite(process.figures.get("peak_rss_bytes"))
            text = label(name) + (f" (peak {peak / 2**20:.0f} MiB)" if peak is not None else "")
            axis.plot([s[0] - origin for s in samples], [s[1] / 2**20 for s in samples], label=text, linewidth=1.2)
            section.series[name] = len(samples)
        axis.set_xlabel("seconds since the run started")
        axis.set_ylabel("MiB")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        _legend(axis, len(section.series))
        section.png = _png(figure)
    missing = [name for name in processes if name not in sampled]
    if missing:
        section.note = "no samples for: " + ", ".join(label(name) for name in missing)
    return section


def cross_site(summary: dict[str, Any]) -> Section:
    """The cross-site evaluation matrix as a heat map: a row per evaluating site, a column per model."""
    section = Section("cross-site", "Cross-site evaluation")
    matrix = summary.get("cross_site_val")
    if not isinstance(matrix, dict) or not matrix:
        section.note = "no cross-site evaluation in this run"
        return section
    rows = [site for site in sorted(matrix, key=str) if isinstance(matrix[site], dict)][: MAX_SERIES * 2]
    models = sorted({str(model) for site in rows for model in matrix[site]}, key=str)[: MAX_SERIES * 2]
    metric = next(
        (key for site in rows for cell in matrix[site].values() if isinstance(cell, dict)
         for key, value in cell.items() if finite(value) is not None),
        None,
    )  # fmt: skip
    if metric is None or not rows or not models:
        section.note = "the cross-site evaluation has no numeric result"
        return section
    values = [[_cell(matrix[site].get(model), metric) for model in models] for site in rows]
    with _plain_text():
        figure, axes = _figure(height_in=max(3.0, 0.5 * len(rows) + 2.0))
        axis = axes[0][0]
        masked = [[v if v is not None else math.nan for v in row] for row in values]
        image = axis.imshow(masked, cmap="viridis", aspect="auto")
        figure.colorbar(image, ax=axis, label=label(metric))
        axis.set_xticks(range(len(models)), [label(m) for m in models], rotation=20, ha="right")
        axis.set_yticks(range(len(rows)), [label(r) for r in rows])
        axis.set_xlabel("model")
        axis.set_ylabel("evaluated at site")
        if len(rows) <= MAX_ANNOTATED and len(models) <= MAX_ANNOTATED:
            for i, row in enumerate(values):
                for j, value in enumerate(row):
                    text = f"{value:.3g}" if value is not None else "-"
                    light = value is not None and float(image.norm(value)) > 0.6  # viridis turns yellow
                    axis.text(j, i, text, ha="center", va="center", color="black" if light else "white", fontsize=9)
        section.png = _png(figure)
    section.series[metric] = sum(v is not None for row in values for v in row)
    section.title = f"Cross-site evaluation ({label(metric)})"
    return section


def _cell(cell: Any, metric: str) -> float | None:
    return finite(cell.get(metric)) if isinstance(cell, dict) else None
