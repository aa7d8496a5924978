"""The report as one self-contained HTML page: inline CSS, plots as base64 PNG, no script, no link out.

Every piece of text from the workspace goes through `html.escape` (attributes too): a metric
named ``<script>`` is shown as that text and does nothing. Each plot's ``<section>`` carries
``data-series``, a JSON object of its series and their lengths, for tools and tests.
"""

from __future__ import annotations

import base64
import html
import json
from datetime import datetime, timezone
from typing import Any

from engine.report.figures import Section, label
from engine.report.workspace import RunData, finite
from engine.text import printable

#: Longest text shown from the workspace in a header field or a note.
MAX_TEXT = 500

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1140px;
       color: #222; line-height: 1.4; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin: 28px 0 6px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.facts td { text-align: left; } .facts th { text-align: left; width: 110px; }
.note { color: #555; font-size: 13px; } .missing { color: #8a4b00; }
.ok { color: #1f7a1f; font-weight: 600; } .bad { color: #b00020; font-weight: 600; }
img { max-width: 100%; border: 1px solid #eee; }
details { margin: 4px 0 12px; } summary { cursor: pointer; font-size: 13px; color: #333; }
"""


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    return html.escape(printable(str(value), limit), quote=True)


def render(data: RunData, sections: list[Section]) -> str:
    """The page of ``data`` with ``sections`` (already drawn)."""
    summary = data.summary
    job = _text(summary.get("job", data.folder.name), 200)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>flengine report: {job}</title><style>{_STYLE}</style></head><body>",
        f"<h1>flengine report: {job}</h1>",
        _facts(data),
        _processes(data),
    ]
    warnings = summary.get("warnings") if isinstance(summary.get("warnings"), list) else []
    if warnings:
        parts.append("<h2>Warnings</h2><ul>" + "".join(f"<li>{_text(w)}</li>" for w in warnings[:50]) + "</ul>")
    missing = list(data.notes) + [f"{section.title}: {section.note}" for section in sections if section.png is None]
    if missing:
        items = "".join(f'<li class="missing">{_text(note)}</li>' for note in missing)
        parts.append(f"<h2>Not shown</h2><ul>{items}</ul>")
    parts.extend(_section(section) for section in sections)
    created = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    parts.append(f'<p class="note">made by flengine report from {_text(data.folder)} at {created}</p>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _facts(data: RunData) -> str:
    summary = data.summary
    status = str(summary.get("status", "unknown (no summary.json)"))
    css = "ok" if status == "FINISHED_COMPLETED" else "bad"
    rows = [("status", f'<span class="{css}">{_text(status)}</span>')]
    if summary.get("reason"):
        rows.append(("reason", _text(summary["reason"])))
    seconds = finite(summary.get("seconds"))
    if seconds is not None:
        rows.append(("run time", f"{seconds:.1f} s"))
    rounds = summary.get("rounds")
    if isinstance(rounds, list):
        rows.append(("rounds", str(len(rounds))))
    clients = summary.get("clients")
    if isinstance(clients, list):
        rows.append(("clients", _text(", ".join(str(c) for c in clients[:100]))))
    rows.append(("workspace", _text(data.folder)))
    body = "".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in rows)
    return f'<table class="facts">{body}</table>'


def _processes(data: RunData) -> str:
    listed = data.summary.get("processes") if isinstance(data.summary.get("processes"), dict) else {}
    names = list(dict.fromkeys([*data.processes, *(str(name) for name in listed)]))
    if not names:
        return ""
    rows = []
    for name in names[:256]:
        entry = listed.get(name) if isinstance(listed.get(name), dict) else {}
        peak = finite(entry.get("peak_rss_mb"))
        process = data.processes.get(name)
        samples = len(process.rss) if process else 0
        code = entry.get("exit_code")
        rows.append(
            f"<tr><td>{_text(label(name))}</td><td>{_text(code if code is not None else '-')}</td>"
            f"<td>{f'{peak:.1f}' if peak is not None else '-'}</td><td>{samples}</td></tr>"
        )
    header = "<tr><th>process</th><th>exit code</th><th>peak RSS (MiB)</th><th>memory samples</th></tr>"
    return f"<h2>Processes</h2><table>{header}{''.join(rows)}</table>"


def _section(section: Section) -> str:
    series = html.escape(json.dumps(section.series, sort_keys=True), quote=True)
    parts = [f'<section id="{_text(section.id, 60)}" data-series="{series}">', f"<h2>{_text(section.title)}</h2>"]
    if section.png is not None:
        encoded = base64.b64encode(section.png).decode("ascii")
        parts.append(f'<img alt="{_text(section.title)}" src="data:image/png;base64,{encoded}">')
    if section.note:
        css = "note" if section.png is not None else "note missing"
        parts.append(f'<p class="{css}">{_text(section.note)}</p>')
    if section.table:
        header, *rows = section.table
        head = "".join(f"<th>{_text(cell)}</th>" for cell in header)
        body = "".join("<tr>" + "".join(f"<td>{_text(cell)}</td>" for cell in row) + "</tr>" for row in rows)
        parts.append(f"<details><summary>table ({len(rows)} rows)</summary>")
        parts.append(f"<table><tr>{head}</tr>{body}</table></details>")
    parts.append("</section>")
    return "\n".join(parts)
