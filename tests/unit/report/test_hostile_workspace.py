"""A damaged or hostile workspace gives a report that says what is missing, or one clear error: never a traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.cli import main
from engine.errors import UsageError
from engine.report import build_report, write_report

HOSTILE_NAME = '<script>alert("x")</script>$x^2$'


def sections_of(workspace: Path) -> dict:
    return {section.id: section for section in build_report(workspace).sections}


def test_a_truncated_summary_is_named_and_the_rest_is_drawn(workspace_copy: Path) -> None:
    summary = workspace_copy / "summary.json"
    summary.write_text(summary.read_text(encoding="utf-8")[:200], encoding="utf-8")

    report = build_report(workspace_copy)

    assert any(note.startswith("summary.json is not valid JSON") for note in report.notes)
    sections = {section.id: section for section in report.sections}
    assert sections["memory"].png is not None and sections["round-times"].png is not None
    assert "unknown (no summary.json)" in report.html


def test_garbage_lines_and_huge_numbers_are_skipped_and_counted(workspace_copy: Path) -> None:
    events = workspace_copy / "server" / "events.jsonl"
    lines = events.read_text(encoding="utf-8").splitlines()
    hostile = [
        '{"event": "round_started", "at": 1e999, "round": 1}',  # inf: not an event
        '{"event": "round_done", "at": 1.0, "round": 123456789012345678901234567890}',
        '{"event": "result_received", "at": 5, "task_id": [], "site": {}}',
        '{"event": "task_sent"',  # truncated
        "\x00\x01 not json",
    ]
    events.write_text("\n".join(lines[:3] + hostile + lines[3:]) + "\n", encoding="utf-8")
    rss = workspace_copy / "site-1" / "rss.csv"
    rss.write_text(rss.read_text(encoding="utf-8") + "1e999,5\nabc,def\n7,-1\n1,2,3\n", encoding="utf-8")
    metrics = workspace_copy / "server" / "metrics.jsonl"
    metrics.write_text(
        metrics.read_text(encoding="utf-8")
        + json.dumps({"site": "site-1", "key": "huge", "value": 10**400, "round": 1})  # an int no float holds
        + "\n"
        + '{"site": "site-1", "key": "nan", "value": NaN, "round": 1}\n',
        encoding="utf-8",
    )

    report = build_report(workspace_copy)

    assert "server/events.jsonl: 2 lines not valid JSON, skipped" in report.notes
    assert "site-1/rss.csv: 4 lines not a sample, skipped" in report.notes
    sections = {section.id: section for section in report.sections}
    assert not any("huge" in name or "nan" in name for name in sections["client-metrics"].series)
    assert sections["round-times"].series == {"sending": 2, "training": 2, "receiving": 2, "aggregating": 2}


def test_html_in_names_is_escaped_everywhere(workspace_copy: Path) -> None:
    line = {"site": HOSTILE_NAME, "key": HOSTILE_NAME, "value": 0.5, "round": 1}
    with (workspace_copy / "server" / "metrics.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
    folder = workspace_copy / '<img src=x onerror="alert(1)">'
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(json.dumps({"key": "k", "value": 1, "round": 1}) + "\n", encoding="utf-8")
    summary = json.loads((workspace_copy / "summary.json").read_text(encoding="utf-8"))
    summary["job"] = HOSTILE_NAME
    summary["warnings"] = [HOSTILE_NAME]
    summary["cross_site_val"] = {HOSTILE_NAME: {HOSTILE_NAME: {HOSTILE_NAME: 0.5}}}
    (workspace_copy / "summary.json").write_text(json.dumps(summary), encoding="utf-8")

    report = build_report(workspace_copy)

    assert "<script" not in report.html and "<img src=x" not in report.html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in report.html
    sections = {section.id: section for section in report.sections}
    assert sections["client-metrics"].series[f"{HOSTILE_NAME} / {HOSTILE_NAME}"] == 1
    assert sections["cross-site"].png is not None  # a $ in a label is text, not mathtext


def test_a_hostile_cross_site_matrix_is_drawn_from_its_numbers_only(workspace_copy: Path) -> None:
    summary = json.loads((workspace_copy / "summary.json").read_text(encoding="utf-8"))
    summary["cross_site_val"] = {
        "site-1": {"m1": {"acc": 0.9}, "m2": {"acc": "high"}, "m3": "not a cell", "m4": {"acc": 1e308 * 10}},
        "site-2": ["not", "a", "row"],
        "site-3": {"m1": {"error": "failed"}, "m2": {"acc": 0.7}},
    }
    (workspace_copy / "summary.json").write_text(json.dumps(summary), encoding="utf-8")

    section = sections_of(workspace_copy)["cross-site"]

    assert section.png is not None and section.series == {"acc": 2}


def test_a_workspace_with_summary_only_lists_what_is_missing(tmp_path: Path, workspace_copy: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "summary.json").write_text((workspace_copy / "summary.json").read_text(encoding="utf-8"))

    report = build_report(bare)

    plotted = [section.id for section in report.sections if section.png is not None]
    assert plotted == ["global-metrics"]
    assert "no memory samples" in report.html and "no round timing" in report.html


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda root: root / "absent", "not a folder", id="missing"),
        pytest.param(lambda root: root, "not a run's workspace", id="empty-folder"),
    ],
)
def test_a_folder_that_is_no_workspace_is_one_clear_error(tmp_path: Path, make, message: str, capsys) -> None:
    code = main(["report", str(make(tmp_path))])

    err = capsys.readouterr().err
    assert code == UsageError.exit_code
    assert err.startswith("Error: ") and message in err and "Traceback" not in err


def test_an_output_that_cannot_be_written_is_a_clear_error(workspace_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot write the report"):
        write_report(workspace_copy, tmp_path / "no-such-folder" / "report.html")


def test_without_matplotlib_the_error_names_the_extra(workspace_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError

    with pytest.raises(UsageError, match=r"pip install flengine\[report\]"):
        build_report(workspace_copy)
