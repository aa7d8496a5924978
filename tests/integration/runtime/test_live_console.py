"""A real run on the live console: a board while it runs, one line per round left, rounds from 1, -v's log lines."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import processes_mentioning, read_json
from tests.integration.runtime.jobkit import make_bench_job
from tests.unit.runtime.terminal import Terminal

_SGR = re.compile(r"\x1b\[[0-9;]*m")


def test_a_run_in_a_terminal_leaves_one_line_per_round_and_shows_the_logs_with_v(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = make_bench_job(tmp_path, num_rounds=2)
    out = io.StringIO()  # `live=True`: drawn as on a terminal

    result = run_simulation(job, workspace=tmp_path / "workspace", out=out, verbose=True, live=True)

    assert processes_mentioning(str(tmp_path)) == []
    assert result.state is JobState.FINISHED_COMPLETED, out.getvalue()
    raw = _SGR.sub("", out.getvalue())
    assert "starting the server and 2 clients" in raw  # the board was drawn ...
    # ... with a line per site (which statuses a fast run shows depends on when the board redraws)
    assert re.search(r"site-1 +(starting|waiting|receiving|downloading|training|sending|idle|done)", raw)
    terminal = Terminal().feed(out.getvalue())
    assert terminal.unknown == []
    left = terminal.lines  # ... and is gone: what stays is one line per round, then the summary
    board = re.compile(
        r"^(site-\d +(starting|waiting|receiving|training|sending|idle|done)|starting the server|workflow \S+,)"
    )
    assert [line for line in left if board.match(line)] == []
    assert [line.split(" done in ")[0] for line in left if line.startswith("[round ")] == [
        "[round 1/2]",
        "[round 2/2]",
    ]
    table = left.index("round  time (s)  metrics")
    assert [line.split()[0] for line in left[table + 1 : table + 3]] == ["1", "2"]
    summary = read_json(tmp_path / "workspace" / "summary.json")
    assert [entry["round"] for entry in summary["rounds"]] == [1, 2]  # counted as the console counts
    events = (tmp_path / "workspace" / "server" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert [e["round"] for e in map(json.loads, events) if e["event"] == "round_done"] == [1, 2]
    errors = capsys.readouterr().err  # -v: every process's log lines, as they are written
    for site in ("server", "site-1", "site-2"):
        assert re.search(rf"^{site} \| \S+ \S+ DEBUG ", errors, re.MULTILINE), site
