"""The live console of ``flengine run`` in a terminal: a status line per site, a bar per download.

`SiteBoard` turns the run's events (the server's, and each client's ``events.jsonl``) into what
each site is doing; `LiveConsole` draws it with rich's ``Live`` (transient: the live part leaves
nothing behind) and prints the lines a `ProgressPrinter` prints outside a terminal (one per round)
above it, so the scrollback keeps one line per round. rich is the optional extra ``console``
(``pip install flengine[console]``), imported here only; without it the simulator keeps the
plain lines.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from engine.runtime.progress import MAX_LINE, ProgressPrinter
from engine.text import printable

#: What to install for the live display.
RICH_HINT = "pip install flengine[console]"
#: Redraws per second of the live part.
REFRESH_PER_SECOND = 4
#: Seconds a status must last before its elapsed time is shown.
SHOW_ELAPSED_AFTER_S = 2.0
#: The longest status text (a failure's reason is cut there).
MAX_STATUS = 80
#: Width of a transfer's bar, in characters.
BAR_WIDTH = 24


def rich_available() -> bool:
    """Whether rich (the extra ``console``) can be imported."""
    try:
        import rich.live  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class SiteState:
    """What one site is doing, as the events tell it.

    Attributes:
        status: A short text: ``downloading the model``, ``training``, ``idle`` ...
        since: When the status began (the board's clock).
        at: The event time (``at``, seconds since the epoch) of the last change: an older event
            (a client's file is read a little later than the server's pipe) does not undo it.
        done_bytes: Bytes of the current download so far.
        total_bytes: Bytes of the current download (0: none shown).
        rate_bps: The download's bytes per second (None until known).
        failed: The site failed (its status says how).
        receiving: Its task was sent and its data is not in yet (a download may show).
        task_id: The task it was last sent.
    """

    status: str = "starting"
    since: float = 0.0
    at: float = 0.0
    done_bytes: int = 0
    total_bytes: int = 0
    rate_bps: float | None = None
    failed: bool = False
    receiving: bool = False
    task_id: str = ""


class SiteBoard:
    """Each site's status, updated from the run's events; plain state that tests drive without a terminal.

    Args:
        clients: The run's clients, in the order they are shown.
        clock: Monotonic seconds (for the elapsed time of a status and download rates).
    """

    def __init__(self, clients: list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.sites = {site: SiteState(since=clock()) for site in clients}
        self.workflow = ""
        self.round: int | None = None
        self.total_rounds: int | None = None

    def update(self, event: dict[str, Any]) -> None:
        """Apply one event (unknown events and unknown sites are ignored)."""
        handler = getattr(self, f"_on_{event.get('event')}", None)
        if handler is not None:
            handler(event)

    def header(self) -> str:
        """The live part's first line: the workflow and the round."""
        parts = [f"workflow {self.workflow}" if self.workflow else f"starting the server and {len(self.sites)} clients"]
        if isinstance(self.round, int):
            parts.append(f"round {self.round}/{self.total_rounds if self.total_rounds is not None else '?'}")
        return ", ".join(parts)

    def elapsed_s(self, site: str) -> float:
        """Seconds since ``site``'s status began."""
        return self._clock() - self.sites[site].since

    # ----------------------------------------------------------------- events

    def _set(self, event: dict[str, Any], status: str, failed: bool = False, receiving: bool = False) -> None:
        site = self.sites.get(str(event.get("site")))
        if site is None or (site.failed and not failed):
            return
        at = event.get("at")
        if isinstance(at, (int, float)):
            if at < site.at:
                return
            site.at = float(at)
        site.status = printable(status, MAX_STATUS)
        site.since = self._clock()
        site.failed, site.receiving = failed, receiving
        site.done_bytes, site.total_bytes, site.rate_bps = 0, 0, None

    def _each(self, event: dict[str, Any], sites: list[str], status: str) -> None:
        for site in sites:
            self._set({**event, "site": site}, status)

    def _on_workflow_started(self, event: dict[str, Any]) -> None:
        self.workflow = printable(str(event.get("workflow", "")), MAX_STATUS)
        self.round = self.total_rounds = None
        self._each(event, list(self.sites), "idle")

    def _on_round_started(self, event: dict[str, Any]) -> None:
        if isinstance(event.get("round"), int):
            self.round = event["round"]
        if isinstance(event.get("total_rounds"), int):
            self.total_rounds = event["total_rounds"]
        targets = event.get("clients")
        if targets:  # Swarm passes an empty list: the clients pass the model among themselves
            self._each(event, [str(site) for site in targets], "waiting for its task")

    def _on_task_sent(self, event: dict[str, Any]) -> None:
        self._set(event, f"receiving its {event.get('task', '')} task", receiving=True)
        state = self.sites.get(str(event.get("site")))
        if state is not None:
            state.task_id = str(event.get("task_id", ""))

    def _on_download_progress(self, event: dict[str, Any]) -> None:
        """The server's count of the task's bytes a site pulled: a bar, while its data is not in."""
        site = self.sites.get(str(event.get("site")))
        done, total = event.get("bytes"), event.get("total")
        if site is None or not site.receiving or str(event.get("task_id", site.task_id)) != site.task_id:
            return
        if not isinstance(done, int) or not isinstance(total, int) or total <= 0 or done <= site.done_bytes:
            return
        site.status = "downloading the model"
        seconds = self._clock() - site.since
        site.rate_bps = done / seconds if seconds > 0 else None
        site.done_bytes, site.total_bytes = min(done, total), total
        if done >= total:  # the client's own event says when it starts training
            site.status, site.receiving = f"model downloaded ({size_text(total)})", False

    def _on_task_received(self, event: dict[str, Any]) -> None:  # a client's event: the task data is in
        task = str(event.get("task", "task"))
        self._set(event, "training" if task == "train" else f"running {task}")

    def _on_task_done(self, event: dict[str, Any]) -> None:  # a client's event: its result goes out now
        self._set(event, "sending its result")

    def _on_result_uploading(self, event: dict[str, Any]) -> None:
        self._set(event, "sending its result")

    def _on_result_received(self, event: dict[str, Any]) -> None:
        if event.get("ok") is False:
            self._set(event, f"idle: its {event.get('task', 'task')} result was an error")
            return
        size, seconds = event.get("bytes"), event.get("seconds")
        if isinstance(size, int) and size > 0 and isinstance(seconds, (int, float)):
            rate = size / max(seconds, 1e-9) / 2**20
            self._set(event, f"idle (result sent: {size_text(size)} in {seconds:.2f} s, {rate:.0f} MiB/s)")
        else:
            self._set(event, "idle")

    def _on_round_done(self, event: dict[str, Any]) -> None:
        failed = event.get("failed")
        for site, why in failed.items() if isinstance(failed, dict) else []:
            self._set({**event, "site": site}, f"idle: failed this round: {why}")

    def _on_client_dead(self, event: dict[str, Any]) -> None:
        self._set(event, f"dead: {event.get('reason') or 'stopped answering'}", failed=True)

    def _on_worker_dead(self, event: dict[str, Any]) -> None:
        self._set(event, f"dead ({event.get('reason') or 'died'}): its {event.get('clients', '')} clients", failed=True)

    def _on_worker_back(self, event: dict[str, Any]) -> None:
        self._on_client_back(event)

    def _on_client_back(self, event: dict[str, Any]) -> None:
        site = self.sites.get(str(event.get("site")))
        if site is not None:
            site.failed = False  # alive again: its next states are shown
        self._set(event, "back: takes part from the next round")

    def _on_process_exited(self, event: dict[str, Any]) -> None:  # the simulator's own event
        code = event.get("code")
        self._set(event, f"{'exited' if code == 0 else 'failed: exited'} (code {code})", failed=code != 0)

    def _on_job_done(self, event: dict[str, Any]) -> None:
        self._each(event, [site for site, state in self.sites.items() if not state.failed], "done")


class LiveConsole(ProgressPrinter):
    """A `ProgressPrinter` for a terminal: the lines it prints go above a live status board.

    Lines (one per round, warnings, errors, the summary) are printed with ``console.print`` and
    stay in the scrollback; the board (a line per site and a bar per download with MiB/s) is
    redrawn below them a few times a second and erased by `close`.

    Args:
        console: The rich ``Console`` to draw on (a terminal).
        clients: The run's clients.
        clock: Monotonic seconds (tests pass their own).
        auto_refresh: Redraw from a thread (False: only when a line is printed or `refresh` is called).
    """

    def __init__(
        self,
        console: Any,
        clients: list[str],
        clock: Callable[[], float] = time.monotonic,
        auto_refresh: bool = True,
    ) -> None:
        from rich.live import Live

        super().__init__(console.file, clients, detail=False)
        self.console = console
        self.board = SiteBoard(clients, clock)
        stderr_is_terminal = _is_terminal(sys.stderr)
        self._live = Live(
            console=console,
            get_renderable=self.render,
            transient=True,
            auto_refresh=auto_refresh,
            refresh_per_second=REFRESH_PER_SECOND,
            redirect_stdout=False,
            redirect_stderr=stderr_is_terminal,  # stray writes to a terminal's stderr go above the board
        )
        self._started = False

    def start(self) -> None:
        """Show the board."""
        if not self._started:
            self._started = True
            self._live.start()

    def close(self) -> None:
        """Erase the board (what was printed stays); safe to call twice."""
        if self._started:
            self._started = False
            self._live.stop()

    def refresh(self) -> None:
        """Redraw the board now."""
        if self._started:
            self._live.refresh()

    def line(self, text: str) -> None:
        """Print one line above the board; it stays in the scrollback."""
        self.console.print(printable(text, MAX_LINE), markup=False, highlight=False, emoji=False, soft_wrap=True)

    def log(self, site: str, text: str) -> None:
        """One line of a process's log (``-v``): above the board when stderr is this terminal."""
        if _is_terminal(sys.stderr) or self.console.file is sys.stderr:
            self.console.print(
                f"{site} | {printable(text, MAX_LINE)}", markup=False, highlight=False, emoji=False, style="dim"
            )
        else:
            super().log(site, text)

    def show(self, event: dict[str, Any]) -> None:
        """Update the board from one event and print the event's line, if it has one outside a terminal."""
        self.board.update(event)
        super().show(event)

    def render(self) -> Any:
        """The board: a header line, then a line per site (with a bar while it downloads)."""
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        table = Table.grid(padding=(0, 1))
        table.add_row(Text(self.board.header(), style="bold"))
        rows = Table.grid(padding=(0, 2))
        for site, state in self._shown_sites():
            style = "red" if state.failed else ""
            status = Text(state.status, style=style)
            elapsed = self.board.elapsed_s(site) if site in self.board.sites else 0.0
            if elapsed >= SHOW_ELAPSED_AFTER_S and not state.failed and state.status != "done":
                status.append(f"  {elapsed:.0f} s", style="dim")
            if state.total_bytes and state.done_bytes < state.total_bytes:
                bar = ProgressBar(total=state.total_bytes, completed=state.done_bytes, width=BAR_WIDTH)
                rate = f"{state.rate_bps / 2**20:.0f} MiB/s" if state.rate_bps else ""
                figures = Text(f"{size_text(state.done_bytes)} of {size_text(state.total_bytes)}  {rate}")
                rows.add_row(Text(site, style="bold"), status, bar, figures)
            else:
                rows.add_row(Text(site, style="bold"), status)
        table.add_row(rows)
        return table

    def _shown_sites(self) -> list[tuple[str, SiteState]]:
        """The sites that fit the terminal: busy and failed ones first when not all do."""
        sites = list(self.board.sites.items())
        room = max(self.console.height - 3, 4)
        if len(sites) <= room:
            return sites
        quiet = ("idle", "done", "starting")
        busy = [(site, state) for site, state in sites if not state.status.startswith(quiet)]
        rest = [(site, state) for site, state in sites if state.status.startswith(quiet)]
        shown = (busy + rest)[: room - 1]
        hidden = len(sites) - len(shown)
        return [*shown, (f"+{hidden} more", SiteState(status=""))]


def size_text(size: int) -> str:
    """Bytes as people read them: ``512 B``, ``19 KiB``, ``3.0 MiB``, ``1.25 GiB``."""
    if size < 2**10:
        return f"{size} B"
    if size < 2**20:
        return f"{size / 2**10:.0f} KiB"
    if size < 2**30:
        return f"{size / 2**20:.1f} MiB"
    return f"{size / 2**30:.2f} GiB"


def make_printer(out: IO[str], clients: list[str], live: bool | None = None) -> ProgressPrinter:
    """The console of a run: `LiveConsole` in a terminal where rich is installed, a `ProgressPrinter` otherwise.

    Args:
        out: Where the run's lines go.
        clients: The run's clients.
        live: True or False to choose; None: live when ``out`` is a terminal and rich is installed.
            True without rich falls back to the plain lines, with a line saying what to install.
    """
    terminal = _is_terminal(out)
    if not (terminal if live is None else live):
        return ProgressPrinter(out, clients, detail=False)
    if not rich_available():  # the lines of each step of a round, as before the live display
        printer = ProgressPrinter(out, clients, detail=terminal)
        printer.line(f"(for a live display of each site's progress: {RICH_HINT})")
        return printer
    from rich.console import Console

    console = Console(file=out, force_terminal=True if live else None, highlight=False, emoji=False)
    if live is None and (console.is_dumb_terminal or not console.is_terminal):  # TERM=dumb: no cursor moves
        return ProgressPrinter(out, clients, detail=True)
    return LiveConsole(console, clients)


def _is_terminal(out: IO[str]) -> bool:
    isatty = getattr(out, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):
        return False
