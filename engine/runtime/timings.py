"""`RunTimings`: when each stage of a ``flengine run`` was reached, for ``summary.json`` and ``-v``.

A run spends time outside its rounds: starting the processes (imports), the server binding its
port, the clients building their executors and registering, and at the end the processes
exiting and the summary being written. The simulator marks each stage as it sees it (the
processes' events carry the time they happened, ``at``, on the same clock) and keeps them in
``summary.json`` under ``timings``::

    "timings": {
      "stages": {"launcher_ready": 1.41, "server_listening": 1.52, "clients_ready": 1.55,
                 "clients_registered": 1.63, "first_round_started": 1.64, "last_round_done": 4.02,
                 "job_done": 4.05, "processes_exited": 4.11, "summary_written": 4.12},
      "clients_ready": {"site-1": 1.53, "site-2": 1.55},
      "outside_rounds_s": 1.74
    }

Each stage is in seconds since the simulator started (``run_simulation`` was called). The
stages follow one another in the order of `STAGES`, except ``server_listening`` and
``clients_ready``: the server and the clients start at the same time. A stage the run never
reached (a job that failed early) is absent. ``outside_rounds_s`` is the run's time minus the
time from the first round's start to the last round's end.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

#: The stages, in the order a run reaches them, each with what it means.
STAGES: dict[str, str] = {
    "launcher_ready": "the job processes' imports done (torch once)",
    "server_listening": "the server bound its port",
    "clients_ready": "every client built its executors",
    "clients_registered": "every client asked for work; the first workflow starts",
    "first_round_started": "the first round started",
    "last_round_done": "the last round ended",
    "job_done": "the server wrote its result",
    "processes_exited": "every job process exited",
    "summary_written": "summary.json written",
}
#: Stages that may come in either order (the server and the clients start together).
CONCURRENT = frozenset({"server_listening", "clients_ready"})


class RunTimings:
    """The time of each stage of one run; plain state that tests drive without processes.

    Args:
        started: When the run started, in seconds since the epoch (now by default).
    """

    def __init__(self, started: float | None = None) -> None:
        self.started = time.time() if started is None else started
        self._at: dict[str, float] = {}
        self._clients: dict[str, float] = {}

    def mark(self, stage: str, at: float | None = None, *, first: bool = True) -> None:
        """Record that ``stage`` was reached ``at`` (seconds since the epoch; now by default).

        Args:
            stage: One of `STAGES`.
            at: When; an event's ``at``, or now.
            first: Keep the first time the stage is marked (False: the last, as for ``last_round_done``).
        """
        if stage not in STAGES:
            raise ValueError(f"unknown run stage {stage!r}; expected one of {', '.join(STAGES)}")
        if first and stage in self._at:
            return
        self._at[stage] = time.time() if at is None else float(at)

    def from_event(self, event: dict[str, Any]) -> None:
        """Mark the stage a server event says was reached (other events are ignored)."""
        stage = {
            "listening": "server_listening",
            "workflow_started": "clients_registered",
            "round_started": "first_round_started",
            "job_done": "job_done",
        }.get(str(event.get("event")))
        at = event.get("at")
        at = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None
        if event.get("event") == "round_done":
            self.mark("last_round_done", at, first=False)
        elif stage is not None:
            self.mark(stage, at)

    def client_ready(self, site: str, at: float) -> None:
        """Record when ``site`` had built its executors; ``clients_ready`` is the last of them."""
        self._clients[site] = float(at)
        self._at["clients_ready"] = max(self._clients.values())

    def seconds(self) -> dict[str, float]:
        """Each stage reached, in seconds since the start, in the order of `STAGES`."""
        return {stage: round(self._at[stage] - self.started, 3) for stage in STAGES if stage in self._at}

    def to_summary(self) -> dict[str, Any]:
        """The ``timings`` object of ``summary.json`` (see the module's docstring)."""
        stages = self.seconds()
        summary: dict[str, Any] = {
            "stages": stages,
            "clients_ready": {site: round(at - self.started, 3) for site, at in sorted(self._clients.items())},
        }
        end = max(self._at.values(), default=self.started)
        total = end - self.started
        if "first_round_started" in self._at and "last_round_done" in self._at:
            total -= max(self._at["last_round_done"] - self._at["first_round_started"], 0.0)
        summary["outside_rounds_s"] = round(total, 3)
        return summary


def timing_lines(timings: dict[str, Any]) -> list[str]:
    """The ``timing:`` block of ``flengine run -v``: each stage, seconds since the start and since the one before."""
    stages = timings.get("stages") or {}
    if not isinstance(stages, dict) or not stages:
        return []
    lines = ["timing (seconds since the run started, + since the stage before):"]
    before = 0.0
    width = max(len(stage) for stage in stages)
    for stage, seconds in _known(stages.items()):
        lines.append(f"  {stage:<{width}}  {seconds:7.2f}  (+{max(seconds - before, 0.0):.2f})  {STAGES[stage]}")
        before = seconds
    outside = timings.get("outside_rounds_s")
    if isinstance(outside, (int, float)):
        lines.append(f"  {'outside rounds':<{width}}  {outside:7.2f}")
    return lines


def _known(items: Iterable[tuple[Any, Any]]) -> list[tuple[str, float]]:
    return [(str(k), float(v)) for k, v in items if k in STAGES and isinstance(v, (int, float))]
