"""How the simulator shows a running job: progress lines from the server's events, a summary table."""

from __future__ import annotations

import sys
from typing import IO, Any

from engine.text import printable

#: The longest line a progress event or the summary prints (text a peer sent is cut there).
MAX_LINE = 400


#: Events shown only in detail (a terminal): the steps inside a round. Elsewhere (a pipe, a log
#: file) a round is the one line of its end, so a 200-round job prints about 200 lines.
DETAIL_EVENTS = frozenset({"round_started", "task_sent", "result_received"})


class ProgressPrinter:
    """Turns the server's progress events into short lines: round k of R, who trains, transfer rates.

    Args:
        out: Where the lines go.
        clients: The run's clients.
        detail: Show each step of a round (who trains, each result with its MB/s); by default
            when ``out`` is a terminal. Otherwise one line per round.
    """

    def __init__(self, out: IO[str], clients: list[str], detail: bool | None = None) -> None:
        self.out = out
        self.clients = clients
        self.detail = _is_terminal(out) if detail is None else detail
        self.round = "?"
        self.total = "?"
        self.workflow = ""
        self._noted: set[str] = set()

    def start(self) -> None:
        """Begin showing the run (nothing to do for plain lines; see `engine.runtime.live.LiveConsole`)."""

    def close(self) -> None:
        """Stop showing the run; lines printed after it still appear."""

    def line(self, text: str) -> None:
        """Print one line; what a peer wrote in it (metric names, reasons) cannot act on the terminal."""
        print(printable(text, MAX_LINE), file=self.out, flush=True)

    def log(self, site: str, text: str) -> None:
        """Print one line of a process's log (``-v``) on stderr, as ``site | line``."""
        print(f"{site} | {printable(text, MAX_LINE)}", file=sys.stderr, flush=True)

    def noted(self, site: str) -> bool:
        """True the second time a site is asked about (so its exit is reported once)."""
        seen = site in self._noted
        self._noted.add(site)
        return seen

    def show(self, event: dict[str, Any]) -> None:
        """Print the line of one server event (round starts update the round number even when not shown)."""
        kind = event.get("event")
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None:
            return
        if kind in DETAIL_EVENTS and not self.detail:
            if kind == "round_started":
                self._track_round(event)
            return
        handler(event)

    def _track_round(self, event: dict[str, Any]) -> None:
        self.round = event["round"] if isinstance(event.get("round"), int) else "?"  # 1-based (the server's)
        self.total = event.get("total_rounds", "?")

    def _prefix(self) -> str:
        if self.round == "?" and self.total == "?" and self.workflow:
            return f"[{self.workflow}]"
        return f"[round {self.round}/{self.total}]"

    def _on_listening(self, event: dict[str, Any]) -> None:
        self.line(f"server listening on {event['endpoint']}; starting {', '.join(self.clients)}")

    def _on_workflow_started(self, event: dict[str, Any]) -> None:
        self.round, self.total, self.workflow = "?", "?", str(event["workflow"])
        self.line(f"workflow {event['workflow']} {'resumed' if event.get('resumed') else 'started'}")

    def _on_round_started(self, event: dict[str, Any]) -> None:
        self._track_round(event)
        targets = event.get("clients")
        if targets is None or targets:
            self.line(f"{self._prefix()} sending the model to {', '.join(targets or []) or 'the clients'}")
        else:  # clients pass the model among themselves (Swarm)
            self.line(f"{self._prefix()} started")

    def _on_task_sent(self, event: dict[str, Any]) -> None:
        self.line(f"{self._prefix()} {event['site']}: {event['task']} started")

    def _on_result_received(self, event: dict[str, Any]) -> None:
        size, seconds = event.get("bytes", 0), event.get("seconds", 0.0)
        if event.get("ok") is False or not size:  # a failed result, or a control task's: no transfer to show
            return
        rate = f", {size / max(seconds, 1e-9) / 2**20:.0f} MiB/s" if size else ""
        self.line(
            f"{self._prefix()} {event['site']}: result received ({size / 2**20:.1f} MiB in {seconds:.2f} s{rate})"
        )

    def _on_client_dead(self, event: dict[str, Any]) -> None:
        why = event.get("reason") or "stopped answering"
        self.line(f"{self._prefix()} {event['site']}: dead ({why}); left out of the rounds until it comes back")

    def _on_client_back(self, event: dict[str, Any]) -> None:
        self.line(f"{self._prefix()} {event['site']}: back; it takes part again from the next round")

    def _on_worker_dead(self, event: dict[str, Any]) -> None:
        clients = event.get("clients", "its")
        self.line(f"{self._prefix()} {event['site']} {event.get('reason') or 'died'}: its {clients} clients are dead")

    def _on_worker_back(self, event: dict[str, Any]) -> None:
        clients = event.get("clients", "its")
        self.line(f"{self._prefix()} {event['site']} is back: its {clients} clients take part from the next round")

    def _on_round_replacements(self, event: dict[str, Any]) -> None:
        lost, drawn = ", ".join(event.get("lost") or []), ", ".join(event.get("drawn") or [])
        self.line(f"{self._prefix()} {lost} died during the round; asking {drawn} instead")

    def _on_round_retried(self, event: dict[str, Any]) -> None:
        lost = ", ".join(event.get("lost") or [])
        self.line(f"{self._prefix()} too few results after {lost} died; playing the round again")

    def _on_workflow_resumed(self, event: dict[str, Any]) -> None:
        self._track_round(event)
        self.line(f"{self._prefix()} resuming here: the rounds before it were played before the server stopped")

    def _on_checkpoint_failed(self, event: dict[str, Any]) -> None:
        self.line(f"{self._prefix()} checkpoint not written ({event.get('reason', '')}); the job goes on")

    def _on_waiting_for_sites(self, event: dict[str, Any]) -> None:
        alive, needed = len(event.get("alive") or []), event.get("needed")
        dead = ", ".join(sorted(event.get("dead") or {}))
        self.line(
            f"{self._prefix()} waiting up to {event.get('timeout_s', 0):g} s for sites: {alive} alive, "
            f"{needed} needed; dead: {dead}"
        )

    def _on_round_done(self, event: dict[str, Any]) -> None:
        metrics = _format_metrics(event.get("metrics") or {})
        clients = event.get("clients") or []
        prefix = self._prefix()
        if isinstance(event.get("round"), int) and self.total != "?":
            prefix = f"[round {event['round']}/{self.total}]"
        refused = sorted(event.get("refused") or {})
        self.line(
            f"{prefix} done in {event.get('time_s', 0):.2f} s, "
            f"{len(clients)} result{'s' if len(clients) != 1 else ''}{': ' + metrics if metrics else ''}"
            f"{'; refused: ' + ', '.join(refused) if refused else ''}"
        )

    def _on_workflow_note(self, event: dict[str, Any]) -> None:
        self.line(f"{self._prefix()} {event.get('message', '')}")

    def _on_job_done(self, event: dict[str, Any]) -> None:
        reason = f" ({event['reason']})" if event.get("reason") else ""
        self.line(f"server finished: {event.get('state')}{reason}")


def _is_terminal(out: IO[str]) -> bool:
    isatty = getattr(out, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):
        return False


def summary_table(summary: dict[str, Any]) -> list[str]:
    """The lines of the end-of-run summary: rounds, refused results, processes with peak RSS, warnings.

    Every line is made `printable` (cut at `MAX_LINE`): metric names and reasons came from peers.
    """
    return [printable(line, MAX_LINE) for line in _summary_lines(summary)]


def _summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = ["", "round  time (s)  metrics"]
    for entry in summary.get("rounds", []):
        round_number = entry["round"] if isinstance(entry.get("round"), int) else "?"  # 1-based already
        lines.append(
            f"{round_number:>5}  {entry.get('time_s', 0):>8.2f}  {_format_metrics(entry.get('metrics') or {})}"
        )
    if not summary.get("rounds"):
        lines.append("    -         -  (no round finished)")
    refused = summary.get("refused") or {}
    if refused:
        counts = ", ".join(f"{site} x{count}" for site, count in sorted(refused.items()))
        lines += ["", f"results refused (see each round's 'refused' in summary.json): {counts}"]
    lines += ["", "process   peak RSS (MiB)  exit code"]
    for site, entry in summary.get("processes", {}).items():
        rss = entry.get("peak_rss_mb")
        lines.append(f"{site:<8}  {rss if rss is not None else '-':>14}  {entry.get('exit_code')}")
    lines += cross_site_table(summary.get("cross_site_val") or {})
    warnings = summary.get("warnings") or []
    if warnings:  # before the verdict, where a reader of a finished run looks
        lines += ["", *(f"warning: {warning}" for warning in warnings)]
    reason = f" ({summary['reason']})" if summary.get("reason") else ""
    lines += [
        "",
        f"{summary.get('status')}{reason} in {summary.get('seconds', 0):.1f} s",
        f"workspace: {summary.get('workspace')}",
    ]
    return lines


def refused_counts(rounds: list[dict[str, Any]]) -> dict[str, int]:
    """How many results of each site the workflows refused, over ``rounds`` (their ``refused`` entries)."""
    counts: dict[str, int] = {}
    for entry in rounds:
        for site in entry.get("refused") or {}:
            counts[site] = counts.get(site, 0) + 1
    return counts


def cross_site_table(matrix: dict[str, dict[str, Any]]) -> list[str]:
    """Cross-site evaluation as a table: a row per evaluator, a column per model, one metric per cell.

    A cell shows the first metric the evaluator reported (or ``error``); the file beside the
    summary holds every metric and every reason.
    """
    if not matrix:
        return []
    models = sorted({model for row in matrix.values() for model in row})
    width = max(12, *(len(model) for model in models))
    first = next((key for row in matrix.values() for cell in row.values() for key in cell if key != "error"), "")
    lines = ["", f"cross-site evaluation ({first or 'metric'}; rows: evaluators, columns: models)"]
    lines.append(f"{'':<8}  " + "  ".join(f"{model:>{width}}" for model in models))
    for site in sorted(matrix):
        cells = []
        for model in models:
            cell = matrix[site].get(model, {})
            value = cell.get(first) if first in cell else ("error" if "error" in cell else "-")
            cells.append(f"{value:>{width}.4f}" if isinstance(value, float) else f"{value!s:>{width}}")
        lines.append(f"{site:<8}  " + "  ".join(cells))
    return lines


def _format_metrics(metrics: dict[str, Any]) -> str:
    parts = []
    for key, value in metrics.items():
        parts.append(f"{key}={value:.4f}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)
