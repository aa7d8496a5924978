"""The live console: a status line per site and a bar per download in a terminal, one line per round left behind."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from engine.runtime.live import LiveConsole, SiteBoard, make_printer, size_text
from engine.runtime.progress import ProgressPrinter
from tests.unit.runtime.terminal import Terminal

#: The events of a real `flengine run` (2 rounds of a 64 MiB model, 2 clients, streamed in 2 MiB
#: chunks): the server's events.jsonl and each client's, merged by time (``site`` added to a client's).
RECORDED = Path(__file__).parent / "data" / "bench_run_events.jsonl"
CLIENTS = ["site-1", "site-2"]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TerminalStringIO(io.StringIO):
    def isatty(self) -> bool:
        return True


def recorded_events() -> list[dict[str, Any]]:
    events = [json.loads(line) for line in RECORDED.read_text(encoding="utf-8").splitlines()]
    return [event for event in events if event["event"] != "listening"]  # the simulator consumes it


def live_console(width: int = 120, height: int = 30) -> tuple[LiveConsole, io.StringIO, _Clock]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=width, height=height)
    clock = _Clock()
    return LiveConsole(console, CLIENTS, clock=clock, auto_refresh=False), out, clock


def replay(printer: ProgressPrinter, out: io.StringIO, clock: _Clock | None = None) -> list[list[str]]:
    """Feed the recorded run to ``printer``; return the screen after each event."""
    screens = []
    printer.start()
    for event in recorded_events():
        if clock is not None:
            clock.now = event["at"]
        printer.show(event)
        if isinstance(printer, LiveConsole):
            printer.refresh()
        screens.append(Terminal().feed(out.getvalue()).lines)
    printer.close()
    return screens


def test_the_live_display_shows_each_site_and_leaves_one_line_per_round() -> None:
    printer, out, clock = live_console()
    plain_out = io.StringIO()
    rounds = sum(event["event"] == "round_done" for event in recorded_events())

    screens = replay(printer, out, clock)
    replay(make_printer(plain_out, CLIENTS), plain_out)

    shown = {line for screen in screens for line in screen}
    downloading = [line for line in shown if line.startswith("site-1  downloading the model")]
    assert downloading and all("━" in line and "MiB/s" in line and " of 64.0 MiB" in line for line in downloading)
    for status in ("training", "sending its result", "idle (result sent: 64.0 MiB in "):
        assert any(line.startswith(f"site-2  {status}") for line in shown), status
    assert "workflow fedavg, round 2/2" in shown
    terminal = Terminal().feed(out.getvalue())
    assert terminal.unknown == []
    left = terminal.lines  # the board is gone; what stays is what a pipe gets
    assert left == plain_out.getvalue().splitlines()
    assert [line for line in left if line.startswith("[round ")] == [
        "[round 1/2] done in 2.59 s, 2 results",
        "[round 2/2] done in 2.96 s, 2 results",
    ]
    assert len([line for line in left if line.startswith("[round ")]) == rounds
    assert left[0] == "workflow fedavg started" and left[-1] == "server finished: FINISHED_COMPLETED"


def test_the_download_bar_rate_is_bytes_over_the_seconds_since_the_task_was_sent() -> None:
    printer, out, clock = live_console()
    printer.start()
    clock.now = 100.0
    printer.show({"event": "task_sent", "site": "site-1", "task": "train", "task_id": "t1"})
    clock.now = 104.0

    printer.show(
        {"event": "download_progress", "site": "site-1", "task_id": "t1", "bytes": 24 << 20, "total": 64 << 20}
    )
    printer.refresh()

    lines = Terminal().feed(out.getvalue()).lines
    [line] = [line for line in lines if line.startswith("site-1")]
    assert line.startswith("site-1  downloading the model  4 s")
    assert line.endswith(f"24.0 MiB of 64.0 MiB  {24 / 4:.0f} MiB/s")
    printer.close()


def test_many_sites_fit_the_terminal_busy_ones_first() -> None:
    sites = [f"site-{i}" for i in range(1, 41)]
    console = Console(file=io.StringIO(), force_terminal=True, width=100, height=12)
    printer = LiveConsole(console, sites, auto_refresh=False)
    printer.show({"event": "workflow_started", "workflow": "fedavg"})
    printer.show({"event": "task_sent", "site": "site-33", "task": "train"})

    rendered = Terminal().feed(_render(console, printer)).lines

    assert len(rendered) <= 12 - 2
    assert rendered[1].split(maxsplit=1) == ["site-33", "receiving its train task"]
    assert rendered[-1].startswith(f"+{40 - (len(rendered) - 2)} more")


def _render(console: Console, printer: LiveConsole) -> str:
    with console.capture() as capture:
        console.print(printer.render())
    return capture.get()


@pytest.mark.parametrize(
    ("terminal", "term", "live", "expected", "detail"),
    [
        pytest.param(False, "xterm", None, ProgressPrinter, False, id="pipe"),
        pytest.param(True, "xterm", None, LiveConsole, False, id="terminal"),
        pytest.param(True, "xterm", False, ProgressPrinter, False, id="terminal-quiet"),
        pytest.param(True, "dumb", None, ProgressPrinter, True, id="dumb-terminal"),
        pytest.param(False, "xterm", True, LiveConsole, False, id="forced"),
    ],
)
def test_make_printer_chooses_the_live_display_in_a_terminal(
    monkeypatch: pytest.MonkeyPatch, terminal: bool, term: str, live: bool | None, expected: type, detail: bool
) -> None:
    monkeypatch.setenv("TERM", term)
    out = _TerminalStringIO() if terminal else io.StringIO()

    printer = make_printer(out, CLIENTS, live)

    assert type(printer) is expected
    assert printer.detail is detail
    assert out.getvalue() == ""


def test_without_rich_a_terminal_keeps_the_step_lines_and_is_told_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "rich.live", None)  # `import rich.live` raises ImportError
    out = _TerminalStringIO()

    printer = make_printer(out, CLIENTS)
    printer.show({"event": "round_started", "round": 1, "total_rounds": 2, "clients": CLIENTS})

    assert type(printer) is ProgressPrinter and printer.detail is True
    assert out.getvalue().splitlines() == [
        "(for a live display of each site's progress: pip install flengine[console])",
        "[round 1/2] sending the model to site-1, site-2",
    ]


# ----------------------------------------------------------------------------- the board


def test_an_older_event_does_not_undo_a_newer_status() -> None:
    board = SiteBoard(CLIENTS)
    board.update({"event": "result_received", "site": "site-1", "bytes": 0, "at": 10.0})

    board.update({"event": "task_done", "site": "site-1", "at": 9.5})  # a client's file, read late

    assert board.sites["site-1"].status == "idle"


def test_a_download_event_counts_only_for_the_task_the_site_is_receiving() -> None:
    board = SiteBoard(CLIENTS)
    board.update({"event": "task_sent", "site": "site-1", "task": "train", "task_id": "t2"})
    board.update({"event": "download_progress", "site": "site-1", "task_id": "t1", "bytes": 5, "total": 10})
    assert board.sites["site-1"].total_bytes == 0  # an earlier task's

    board.update({"event": "task_received", "site": "site-1", "task": "train", "task_id": "t2"})
    board.update({"event": "download_progress", "site": "site-1", "task_id": "t2", "bytes": 10, "total": 10})

    assert board.sites["site-1"].status == "training"  # the server's late count does not undo it


@pytest.mark.parametrize(
    ("events", "status", "failed"),
    [
        pytest.param(
            [{"event": "client_dead", "site": "site-1"}, {"event": "task_sent", "site": "site-1", "task": "train"}],
            "dead: stopped answering",
            True,
            id="dead-stays-failed",
        ),
        pytest.param(
            [
                {"event": "client_dead", "site": "site-1", "reason": "its process exited with code -9"},
                {"event": "client_back", "site": "site-1"},
            ],
            "back: takes part from the next round",
            False,
            id="back-is-alive-again",
        ),
        pytest.param(
            [{"event": "process_exited", "site": "site-1", "code": 1}], "failed: exited (code 1)", True, id="exited"
        ),
        pytest.param(
            [{"event": "round_done", "round": 1, "failed": {"site-1": "NaN in the result"}}],
            "idle: failed this round: NaN in the result",
            False,
            id="round-failure",
        ),
        pytest.param(
            [{"event": "result_received", "site": "site-1", "task": "train", "ok": False}],
            "idle: its train result was an error",
            False,
            id="error-result",
        ),
        pytest.param(
            [{"event": "task_received", "site": "site-1", "task": "validate"}],
            "running validate",
            False,
            id="other-task",
        ),
        pytest.param([{"event": "job_done", "state": "FINISHED_COMPLETED"}], "done", False, id="job-done"),
    ],
)
def test_board_statuses(events: list[dict[str, Any]], status: str, failed: bool) -> None:
    board = SiteBoard(CLIENTS)

    for event in events:
        board.update(event)

    assert (board.sites["site-1"].status, board.sites["site-1"].failed) == (status, failed)


def test_what_a_peer_named_cannot_act_on_the_terminal() -> None:
    board = SiteBoard(CLIENTS)

    board.update({"event": "workflow_started", "workflow": "evil\x1b[2J"})
    board.update({"event": "round_done", "failed": {"site-2": "x\x1b]0;title\x07"}})

    assert board.header() == "workflow evil\\x1b[2J"
    assert "\x1b" not in board.sites["site-2"].status


@pytest.mark.parametrize(
    ("size", "text"),
    [(512, "512 B"), (19_240, "19 KiB"), (3 << 20, "3.0 MiB"), (5 << 29, "2.50 GiB")],
    ids=["bytes", "kib", "mib", "gib"],
)
def test_size_text(size: int, text: str) -> None:
    assert size_text(size) == text
