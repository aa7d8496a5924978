"""The report of a real run: every plot has data, and the figures agree with the run's own files."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from engine.cli import main
from engine.report import REPORT_FILE, Report, build_report, write_report
from engine.report.timeline import PHASES, build_timeline
from engine.report.workspace import read_workspace
from tests.unit.report.conftest import ROUNDS, FinishedRun

SITES = ["site-1", "site-2"]
# jobs/fedavg's Net(hidden=64): Linear(64, 64) and Linear(64, 10), float32.
MODEL_BYTES = ((64 * 64 + 64) + (64 * 10 + 10)) * 4


def events(workspace: Path, process: str) -> list[dict]:
    lines = (workspace / process / "events.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def report(finished_run: FinishedRun) -> Report:
    return build_report(finished_run.workspace)


def test_every_plot_of_a_fedavg_run_has_data(report: Report) -> None:
    sections = {section.id: section for section in report.sections}
    assert sections["global-metrics"].series == {"global_accuracy": ROUNDS, "local_accuracy": ROUNDS}
    assert sections["client-metrics"].series == {f"local_accuracy / {site}": ROUNDS for site in SITES}
    assert sections["round-times"].series == dict.fromkeys(PHASES, ROUNDS)
    assert sections["transfers"].series == {"download": ROUNDS * len(SITES), "upload": ROUNDS * len(SITES)}
    assert sections["timeline"].series == {
        f"{site} / {kind}": ROUNDS for site in SITES for kind in ("download", "train", "upload")
    }
    assert set(sections["memory"].series) == {"server", *SITES}
    assert all(count >= 2 for count in sections["memory"].series.values())
    assert sections["cross-site"].png is None and "no cross-site" in sections["cross-site"].note
    for section in report.sections[:-1]:
        assert section.png is not None and section.png.startswith(b"\x89PNG\r\n\x1a\n"), section.id
    assert report.notes == []


def test_round_phases_add_up_to_the_time_between_the_round_events(finished_run: FinishedRun) -> None:
    server = events(finished_run.workspace, "server")
    starts = {e["round"]: e["at"] for e in server if e["event"] == "round_started"}
    ends = {e["round"]: e["at"] for e in server if e["event"] == "round_done"}

    timeline = build_timeline(read_workspace(finished_run.workspace))

    assert [timing.round for timing in timeline.rounds] == list(range(1, ROUNDS + 1))
    for timing in timeline.rounds:
        expected = ends[timing.round] - starts[timing.round]
        assert sum(timing.phases.values()) == pytest.approx(expected, abs=1e-6)
        assert all(seconds >= 0 for seconds in timing.phases.values())
        # receiving ends with the last result in: the aggregating phase is what follows it
        last_result = max(
            e["at"]
            for e in server
            if e["event"] == "result_received" and starts[timing.round] <= e["at"] <= ends[timing.round]
        )
        assert timing.phases["aggregating"] == pytest.approx(ends[timing.round] - last_result, abs=1e-6)


def test_transfers_carry_the_model_size_and_the_measured_speed(finished_run: FinishedRun) -> None:
    uploads = [(e["site"], e) for e in events(finished_run.workspace, "server") if e["event"] == "result_received"]
    downloads = [
        (site, e) for site in SITES for e in events(finished_run.workspace, site) if e["event"] == "task_received"
    ]

    timeline = build_timeline(read_workspace(finished_run.workspace))

    assert {t.bytes for t in timeline.transfers} == {MODEL_BYTES}
    by_end = {(t.direction, t.site, round(t.end, 4)): t for t in timeline.transfers}  # two sites may end together
    for direction, raw in (("upload", uploads), ("download", downloads)):
        for site, event in raw:
            transfer = by_end[(direction, site, round(event["at"], 4))]
            assert transfer.mib_per_s == pytest.approx(MODEL_BYTES / event["seconds"] / 2**20)
    assert sorted(t.round for t in timeline.transfers) == sorted(list(range(1, ROUNDS + 1)) * 4)


def test_the_page_is_self_contained_and_its_series_are_readable(finished_run: FinishedRun, tmp_path: Path) -> None:
    report = write_report(finished_run.workspace, tmp_path / "page.html")

    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert report.path == (tmp_path / "page.html").resolve()
    assert "<script" not in page and "http://" not in page and "https://" not in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 6 and all(base64.b64decode(image).startswith(b"\x89PNG") for image in images)
    found = dict(re.findall(r'<section id="([^"]+)" data-series="([^"]*)"', page))
    assert {key: json.loads(html.unescape(value)) for key, value in found.items()} == {
        section.id: section.series for section in report.sections
    }


def test_the_run_prints_the_command_that_makes_its_report(finished_run: FinishedRun) -> None:
    assert finished_run.output.splitlines()[-1] == f"report: flengine report {finished_run.workspace}"


def test_cli_report_writes_the_page_and_answers_in_json(finished_run: FinishedRun, tmp_path: Path) -> None:
    stdout = io.StringIO()
    output = tmp_path / "out.html"

    with redirect_stdout(stdout):
        code = main(["report", str(finished_run.workspace), "-o", str(output), "--format", "json"])

    document = json.loads(stdout.getvalue())
    assert code == 0 and output.is_file()
    assert document["report"] == str(output.resolve())
    assert [s["id"] for s in document["sections"] if s["plotted"]] == [
        "global-metrics", "client-metrics", "round-times", "timeline", "transfers", "memory",
    ]  # fmt: skip
    assert document["notes"] == []


def test_cli_report_defaults_to_the_workspace(workspace_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["report", str(workspace_copy)])

    out = capsys.readouterr().out
    assert code == 0 and (workspace_copy / REPORT_FILE).is_file()
    assert out.splitlines()[0] == f"report: {(workspace_copy / REPORT_FILE).resolve()} (6 of 7 plots)"
    assert "not shown: Cross-site evaluation: no cross-site evaluation in this run" in out
