"""What the events of a run say about time: each round's phases, each transfer's size and speed.

The server's ``events.jsonl`` has ``round_started``/``round_done``, ``task_sent``,
``result_uploading`` and ``result_received`` (bytes, seconds); each client's has
``task_received`` (bytes, seconds: the task's download) and ``task_done``. Every event has
``at`` (seconds since the epoch), the task events a ``task_id`` that ties them together, and
every ``round`` is 1-based (as users see it).

A round's phases run one after the other and each ends when its *last* site is through it:
sending ends when the last site has downloaded the model, training when the last one starts
to upload its result, receiving when the last result is in, aggregating when the round is
done (aggregation, the persistor's save and whatever else the workflow does at the round's
end). They add up to the round's time. Where sites overlap (one uploads while another still
trains) the phases follow the slowest site, which is the one the round waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.report.workspace import RunData, finite

PHASES = ("sending", "training", "receiving", "aggregating")


@dataclass
class RoundTiming:
    """One round: its 1-based number, start and end (epoch seconds), and its phases in seconds.

    ``phases`` is empty when the events cannot split the round (no task events: clients
    passed the model among themselves, or the run predates these events).
    """

    round: int
    start: float
    end: float
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """The round's time."""
        return self.end - self.start


@dataclass
class Transfer:
    """One model moved: ``download`` (server to client) or ``upload`` (client to server)."""

    direction: str
    site: str
    task: str
    round: int | None  # 1-based, as in the events; None for a task outside rounds (cross-site evaluation ...)
    bytes: int
    seconds: float
    end: float  # epoch seconds

    @property
    def mib_per_s(self) -> float | None:
        """Speed in MiB/s; None when the transfer took no measurable time."""
        return self.bytes / self.seconds / 2**20 if self.seconds > 0 else None


@dataclass
class Span:
    """One site busy with one step of a task, for the timeline: ``kind`` is download, train or upload."""

    site: str
    kind: str
    start: float
    seconds: float


@dataclass
class _Task:
    site: str
    name: str
    round: int | None
    sent: float | None = None
    downloaded: float | None = None  # end of the client's download
    download_s: float | None = None
    download_bytes: int = 0
    trained: float | None = None  # the client's task_done
    upload_start: float | None = None
    uploaded: float | None = None
    upload_s: float | None = None
    upload_bytes: int = 0


@dataclass
class Timeline:
    """Rounds, transfers and spans derived from a run's events (see the module's docstring)."""

    rounds: list[RoundTiming] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    origin: float | None = None  # the earliest event or sample: time 0 of the plots


def build_timeline(data: RunData) -> Timeline:
    """Derive the `Timeline` of the run in ``data`` (what its events allow; empty without events)."""
    timeline = Timeline()
    server = data.server
    tasks = _tasks(data)
    timeline.rounds = _rounds(server.events if server else [], tasks)
    for task in tasks.values():
        _add_transfers(timeline, task)
        _add_spans(timeline, task)
    timeline.transfers.sort(key=lambda transfer: transfer.end)
    starts = [event["at"] for process in data.processes.values() for event in process.events[:1]]
    starts += [process.rss[0][0] for process in data.processes.values() if process.rss]
    timeline.origin = min(starts) if starts else None
    return timeline


def _tasks(data: RunData) -> dict[str, _Task]:
    tasks: dict[str, _Task] = {}
    server = data.server
    for event in server.events if server else []:
        task_id, kind = event.get("task_id"), event["event"]
        if not isinstance(task_id, str) or not isinstance(event.get("site"), str):
            continue
        if kind == "task_sent":
            round_index = event.get("round") if type(event.get("round")) is int else None
            tasks[task_id] = _Task(event["site"], str(event.get("task", "")), round_index, sent=event["at"])
        task = tasks.get(task_id)
        if task is None or task.site != event["site"]:
            continue
        if kind == "result_uploading":
            task.upload_start = event["at"]
        elif kind == "result_received" and event.get("ok") is not False:
            task.uploaded, task.upload_s = event["at"], _seconds(event)
            task.upload_bytes = _bytes(event)
    for name, process in data.processes.items():
        if name == "server":
            continue
        for event in process.events:
            task = tasks.get(event.get("task_id"))  # type: ignore[arg-type]
            if task is None or task.site != name:  # a client speaks for itself only
                continue
            if event["event"] == "task_received":
                task.downloaded, task.download_s, task.download_bytes = event["at"], _seconds(event), _bytes(event)
            elif event["event"] == "task_done":
                task.trained = event["at"]
    return tasks


def _seconds(event: dict[str, Any]) -> float | None:
    seconds = finite(event.get("seconds"))
    return seconds if seconds is not None and seconds >= 0 else None


def _bytes(event: dict[str, Any]) -> int:
    size = finite(event.get("bytes"))
    return int(size) if size is not None and size > 0 else 0


def _rounds(events: list[dict[str, Any]], tasks: dict[str, _Task]) -> list[RoundTiming]:
    """Each round_started .. round_done pair, split into phases by the tasks sent in it."""
    rounds, open_rounds = [], {}
    for event in events:
        index = event.get("round")
        if type(index) is not int or index < 1:
            continue
        if event["event"] == "round_started":
            open_rounds[index] = event["at"]
        elif event["event"] == "round_done" and index in open_rounds:
            start = open_rounds.pop(index)
            if event["at"] >= start:
                rounds.append(RoundTiming(index, start, event["at"]))
    for timing in rounds:
        members = [
            task
            for task in tasks.values()
            if task.round == timing.round and task.sent is not None and timing.start <= task.sent <= timing.end
        ]
        timing.phases = _phases(timing, members)
    return rounds


def _phases(timing: RoundTiming, members: list[_Task]) -> dict[str, float]:
    done = [task for task in members if task.uploaded is not None]
    if not done or any(task.downloaded is None for task in done):
        return {}
    ends = [
        max(task.downloaded for task in done if task.downloaded is not None),
        max(task.trained or task.upload_start or task.uploaded for task in done if task.uploaded is not None),
        max(task.uploaded for task in done if task.uploaded is not None),
        timing.end,
    ]
    phases, previous = {}, timing.start
    for name, end in zip(PHASES, ends, strict=True):
        end = min(max(end, previous), timing.end)  # clocks of one host; never outside the round
        phases[name] = end - previous
        previous = end
    return phases


def _add_transfers(timeline: Timeline, task: _Task) -> None:
    number = task.round
    if task.downloaded is not None and task.download_bytes and task.download_s is not None:
        timeline.transfers.append(
            Transfer("download", task.site, task.name, number, task.download_bytes, task.download_s, task.downloaded)
        )
    if task.uploaded is not None and task.upload_bytes and task.upload_s is not None:
        timeline.transfers.append(
            Transfer("upload", task.site, task.name, number, task.upload_bytes, task.upload_s, task.uploaded)
        )


def _add_spans(timeline: Timeline, task: _Task) -> None:
    if task.downloaded is not None and task.download_s is not None:
        timeline.spans.append(Span(task.site, "download", task.downloaded - task.download_s, task.download_s))
    upload_start = task.uploaded - task.upload_s if task.uploaded is not None and task.upload_s is not None else None
    train_end = task.trained or upload_start
    if task.downloaded is not None and train_end is not None and train_end >= task.downloaded:
        timeline.spans.append(Span(task.site, "train", task.downloaded, train_end - task.downloaded))
    if upload_start is not None and task.upload_s is not None:
        timeline.spans.append(Span(task.site, "upload", upload_start, task.upload_s))
