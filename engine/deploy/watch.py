"""``flengine admin watch JOB`` and ``flengine admin logs JOB --follow``: a job, live, from polls of the server.

The admin polls the server with a cursor (`engine.deploy.job_feed`) every `POLL_INTERVAL_S`
(at once while the server has more) until the job has ended and everything it wrote is shown.
`JobView` turns the answers into what the admin reads: the job's state, the current round,
each site's state and last result, each round's metrics; it needs no socket, so tests drive it
with answers. In text mode it prints a line per change (the rounds in the words of ``flengine
run``) and a table of the sites at the end; with ``--format json`` one JSON object per update,
on one line each (JSON lines). Both exit 0 when the job finished completed, 1 otherwise.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from engine.deploy.admin import AdminError, AdminSession
from engine.errors import FlengineError
from engine.runtime.progress import ProgressPrinter
from engine.text import printable

#: Seconds between two polls when the last one brought nothing more to read.
POLL_INTERVAL_S = 1.0
#: Seconds the server has to answer one poll (it reads at most one small piece of a file).
POLL_TIMEOUT_S = 15.0
#: The state a job ends well in; any other final state makes the watch exit 1.
COMPLETED = "FINISHED_COMPLETED"
#: Events of the job's server process that the watch does not show (where it listens, transfer ticks).
HIDDEN_EVENTS = frozenset({"listening", "download_progress"})


@dataclass
class SiteView:
    """One site of a watched job, as its server process and the server daemon see it.

    Attributes:
        state: ``waiting`` (no task yet), ``working`` (on ``task``), ``idle`` (its result is in)
            or ``dead`` (the job's server gave up on it; ``detail`` says why).
        task: The task it works on, or worked on last.
        last_result: Its last result: round, ``ok`` or ``failed``, size and time.
        connected: Its client daemon sends the server its status reports.
        detail: Why it is dead.
    """

    state: str = "waiting"
    task: str = ""
    last_result: str = ""
    connected: bool = False
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        """The site as JSON, in each ``--format json`` update."""
        return {
            "state": self.state,
            "task": self.task,
            "last_result": self.last_result,
            "connected": self.connected,
            "detail": self.detail,
        }


class JobView:
    """What a watcher knows of a job, built from the server's ``watch`` answers.

    Args:
        job_id: The watched job.

    Example:
        >>> view = JobView("3f9c0a1b2c4d")
        >>> view.apply({"job": {"job_id": "3f9c0a1b2c4d", "name": "fedavg", "submitter": "alice",
        ...             "status": "RUNNING", "sites": ["site-1"]}, "events": [], "offset": 0,
        ...             "more": False, "sites": {"site-1": {"connected": True}}})
        ['job 3f9c0a1b2c4d (fedavg) of alice: RUNNING on site-1']
    """

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.job: dict[str, Any] = {}
        self.round: int | None = None
        self.total_rounds: int | None = None
        self.sites: dict[str, SiteView] = {}
        self.metrics: dict[str, Any] = {}
        self.metrics_round: int | None = None
        #: The events of the last answer that the watch shows (every one but `HIDDEN_EVENTS`).
        self.new_events: list[dict[str, Any]] = []
        self._text = io.StringIO()
        self._printer = ProgressPrinter(self._text, [], detail=True)

    @property
    def status(self) -> str:
        """The job's state, as its record says (empty before the first answer)."""
        return str(self.job.get("status", ""))

    @property
    def final(self) -> bool:
        """The job has ended (a FINISHED state, or a record the server cannot read)."""
        return self.status.startswith("FINISHED") or self.status == "BROKEN"

    def apply(self, answer: Any) -> list[str]:
        """Take one ``watch`` answer; return the text lines of what changed (empty: nothing did).

        Raises:
            AdminError: The answer is not what ``watch`` answers (an older server, or a bug).
        """
        job, events, sites = _checked_watch_answer(answer)
        lines = self._job_lines(job)
        self.job = job
        self._printer.clients = list(job.get("sites") or [])
        first = not self.sites
        for site, info in sites.items():
            view = self.sites.setdefault(str(site), SiteView())
            connected = bool(isinstance(info, dict) and info.get("connected"))
            if not first and connected != view.connected:
                lines.append(f"{site}: {'connected again' if connected else 'not connected (no status reports)'}")
            view.connected = connected
        self.new_events = [event for event in events if event.get("event") not in HIDDEN_EVENTS]
        for event in self.new_events:
            lines += self._on_event(event)
        return lines

    def snapshot(self, final: bool | None = None) -> dict[str, Any]:
        """One JSON-lines object: the job's state now and the events of the last answer that brought it there.

        Args:
            final: What its ``final`` says (default: whether the job has ended); a watch says it
                on its last line only, once the events of the ended job have all been read.
        """
        return {
            "job_id": self.job_id,
            "status": self.status,
            "reason": self.job.get("reason", ""),
            "final": self.final if final is None else final,
            "round": self.round,
            "total_rounds": self.total_rounds,
            "sites": {site: view.to_json() for site, view in self.sites.items()},
            "metrics": self.metrics,
            "metrics_round": self.metrics_round,
            "events": self.new_events,
        }

    def summary_lines(self) -> list[str]:
        """The end of a text watch: a table of the sites, the last metrics, the final state."""
        lines = []
        if self.sites:
            width = max(4, *(len(site) for site in self.sites))
            lines.append(f"{'site':<{width}}  {'state':<8} {'daemon':<13}  last result")
            for site, view in self.sites.items():
                state = f"{view.state} ({view.detail})" if view.detail else view.state
                daemon = "connected" if view.connected else "not connected"
                lines.append(f"{site:<{width}}  {state:<8} {daemon:<13}  {view.last_result or '-'}")
        if self.metrics:
            lines.append(f"metrics of round {self.metrics_round}: {_metrics_text(self.metrics)}")
        reason = self.job.get("reason")
        lines.append(f"job {self.job_id}: {self.status}{f' ({reason})' if reason else ''}")
        return lines

    # ----------------------------------------------------------------- helpers

    def _job_lines(self, job: dict[str, Any]) -> list[str]:
        """The line of the job's first state, or of a change of it; the final state is `summary_lines`' last line."""
        status, waiting = str(job.get("status")), job.get("waiting")
        if not self.job:
            sites = ", ".join(job.get("sites") or [])
            line = f"job {self.job_id} ({job.get('name')}) of {job.get('submitter')}: {status}"
            line += f" on {sites}" if sites else ""
            return [line + (f"; {waiting}" if waiting else "")]
        if status.startswith("FINISHED") or status == "BROKEN":
            return []
        if status != self.status:
            sites = ", ".join(job.get("sites") or [])
            return [f"job {self.job_id}: {status}{f' on {sites}' if sites else ''}"]
        if waiting and waiting != self.job.get("waiting"):
            return [f"job {self.job_id}: {status}; {waiting}"]
        return []

    def _on_event(self, event: dict[str, Any]) -> list[str]:
        kind = event.get("event")
        site = event.get("site") if isinstance(event.get("site"), str) else ""
        round_number = event.get("round") if isinstance(event.get("round"), int) else None
        if kind in ("round_started", "workflow_resumed"):
            self.round = round_number
            total = event.get("total_rounds")
            self.total_rounds = total if isinstance(total, int) else self.total_rounds
        elif kind == "round_done" and isinstance(event.get("metrics"), dict):
            self.metrics, self.metrics_round = event["metrics"], round_number
        elif site:  # the steps of one site
            self._on_site_event(kind, self.sites.setdefault(site, SiteView()), event)
        lines = self._printed(event)
        if kind == "result_received" and site and event.get("ok") is False:  # `flengine run` shows none
            lines.append(f"[round {self.round or '?'}/{self.total_rounds or '?'}] {site}: result failed")
        return lines

    def _on_site_event(self, kind: Any, view: SiteView, event: dict[str, Any]) -> None:
        if kind == "task_sent":
            view.state, view.task, view.detail = "working", str(event.get("task", "")), ""
        elif kind == "result_received":
            size, seconds = event.get("bytes"), event.get("seconds")
            shown = "ok" if event.get("ok") is not False else "failed"
            shown = f"round {self.round}: {shown}" if self.round is not None else shown
            if isinstance(size, int) and size and isinstance(seconds, (int, float)):
                shown += f" ({size / 2**20:.1f} MiB in {seconds:.2f} s)"
            view.state, view.last_result = "idle", shown
        elif kind == "client_dead":
            view.state, view.detail = "dead", str(event.get("reason") or "stopped answering")
        elif kind == "client_back":
            view.state, view.detail = "idle", ""

    def _printed(self, event: dict[str, Any]) -> list[str]:
        """The lines `flengine run` prints for ``event`` (a malformed event prints none)."""
        try:
            self._printer.show(event)
        except (AttributeError, KeyError, TypeError, ValueError):  # a field missing or of another type: no line
            pass
        lines = self._text.getvalue().splitlines()
        self._text.seek(0)
        self._text.truncate()
        return lines


def watch_job(
    session: AdminSession,
    job_id: str,
    fmt: str,
    out: IO[str] | None = None,
    interval_s: float = POLL_INTERVAL_S,
) -> int:
    """Show ``job_id`` live until it has ended; return 0 when it finished completed, 1 otherwise."""
    out = out or sys.stdout
    view = JobView(job_id)

    def poll(offset: int) -> tuple[int, bool]:
        first, before = not view.job, view.status
        answer = session.command("watch", timeout_s=POLL_TIMEOUT_S, job_id=job_id, offset=offset)
        lines = view.apply(answer)
        more = bool(answer["more"])
        if fmt == "json":
            last = view.final and not more  # this poll ends the watch: its line is the final one
            if first or lines or view.new_events or view.status != before or last:
                _emit(out, json.dumps(view.snapshot(final=last), default=str))
        else:
            for line in lines:
                _emit(out, printable(line))
        return answer["offset"], more

    code = _until_ended(poll, lambda: view.final, out, fmt, interval_s)
    if code is not None:
        return code
    if fmt != "json":
        for line in view.summary_lines():
            _emit(out, printable(line))
    return 0 if view.status == COMPLETED else 1


def follow_log(
    session: AdminSession,
    job_id: str,
    site: str,
    fmt: str,
    out: IO[str] | None = None,
    interval_s: float = POLL_INTERVAL_S,
) -> int:
    """Print a job's log (the last lines, then each new one) until the job has ended; 0 when it completed."""
    out = out or sys.stdout
    state: dict[str, Any] = {}

    def poll(offset: int) -> tuple[int, bool]:
        header = {"job_id": job_id, "site": site, **({"offset": offset} if state else {})}
        answer = _checked_logs_answer(session.command("logs", timeout_s=POLL_TIMEOUT_S, **header))
        first = not state
        state.update(answer)
        if fmt == "json":
            if first or answer["lines"] or answer["ended"]:
                _emit(out, json.dumps({key: answer.get(key) for key in _LOG_KEYS}, default=str))
        else:
            for line in answer["lines"]:
                _emit(out, printable(line))
        return answer["offset"], bool(answer["more"])

    code = _until_ended(poll, lambda: bool(state.get("ended")), out, fmt, interval_s)
    if code is not None:
        return code
    status, reason = state.get("status"), state.get("reason")
    if fmt != "json":  # stdout holds the log alone
        print(printable(f"job {job_id}: {status}{f' ({reason})' if reason else ''}"), file=sys.stderr, flush=True)
    return 0 if status == COMPLETED else 1


_LOG_KEYS = ("job_id", "site", "lines", "status", "reason", "ended")


def _until_ended(
    poll: Callable[[int], tuple[int, bool]], ended: Callable[[], bool], out: IO[str], fmt: str, interval_s: float
) -> int | None:
    """Poll from cursor 0 until ``ended()`` and nothing more is to read; None, or the exit code of a failure.

    With ``--format json`` a failure is one more JSON line, ``{"error", "exit_code"}`` (and the
    ``Error:`` line on stderr), so that stdout stays JSON lines; in text mode it is raised.
    """
    offset = 0
    try:
        while True:
            offset, more = poll(offset)
            if ended() and not more:
                return None
            if not more:
                time.sleep(interval_s)
    except FlengineError as e:
        if fmt != "json":
            raise
        print(f"Error: {e}", file=sys.stderr)
        _emit(out, json.dumps({"error": str(e), "exit_code": e.exit_code}))
        return e.exit_code


def _emit(out: IO[str], line: str) -> None:
    print(line, file=out, flush=True)  # a watcher reads each update as it comes, even through a pipe


def _checked_watch_answer(answer: Any) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    if (
        not isinstance(answer, dict)
        or not isinstance(answer.get("job"), dict)
        or not isinstance(answer.get("events"), list)
        or not isinstance(answer.get("sites"), dict)
        or type(answer.get("offset")) is not int
    ):
        raise AdminError("watch: the server's answer is not a watch answer (is the server older than this flengine?)")
    events = [event for event in answer["events"] if isinstance(event, dict)]
    return answer["job"], events, answer["sites"]


def _checked_logs_answer(answer: Any) -> dict[str, Any]:
    if (
        not isinstance(answer, dict)
        or not isinstance(answer.get("lines"), list)
        or type(answer.get("offset")) is not int
        or "ended" not in answer
    ):
        raise AdminError("logs: the server's answer has no cursor to follow (is the server older than this flengine?)")
    answer["lines"] = [str(line) for line in answer["lines"]]
    return answer


def _metrics_text(metrics: dict[str, Any]) -> str:
    return " ".join(
        f"{key}={value:.4f}" if isinstance(value, float) else f"{key}={value}" for key, value in metrics.items()
    )
