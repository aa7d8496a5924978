"""`Task` and `ClientTask`: what a workflow asks clients to do, and one client's share of it."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from enum import Enum
from typing import Any

from engine.model import Shareable

logger = logging.getLogger(__name__)


class TaskCompletionStatus(str, Enum):
    """How a task, or one client's part of it, ended."""

    OK = "OK"
    TIMEOUT = "TIMEOUT"
    ERROR = "ERROR"
    CANCELLED = "CANCELLED"
    ABORTED = "ABORTED"
    IGNORED = "IGNORED"
    CLIENT_DEAD = "CLIENT_DEAD"


class SendOrder(str, Enum):
    """In which order the targets of a `send` or `relay` may take the task."""

    ANY = "ANY"
    SEQUENTIAL = "SEQUENTIAL"


ClientTaskCallback = Callable[["ClientTask"], None]
TaskCallback = Callable[["Task"], None]


class Task:
    """A unit of work a workflow hands to clients through `broadcast`, `send` or `relay`.

    A `Task` object is scheduled once; make a new one for each round. While it runs, the task
    queue owns its bookkeeping fields; read them, do not write them (``data`` excepted: a
    callback may replace it, for example to give the next relay target something else).

    Args:
        name: Task name the clients' executors are chosen by (``train``, ``validate`` ...).
        data: What every client receives; each gets a shallow copy with its own headers.
        props: Free-form values of the workflow, kept with the task and never sent.
        timeout: Seconds after scheduling when the task ends with ``TIMEOUT``; 0 = never.
        before_task_sent_cb: ``cb(client_task)`` before the task goes to a client; it may
            change ``client_task.task.data`` for that client. If it raises, the client does not
            get the task and its client task ends with ``ERROR``.
        after_task_sent_cb: ``cb(client_task)`` once the client's copy of the data is made.
        result_received_cb: ``cb(client_task)`` when a client's result is accepted, in the
            submitting thread; calls for one task never overlap, so it may aggregate without a
            lock of its own. If it raises, the client task ends with ``ERROR`` (raise
            `engine.errors.ResultRefused` to refuse a result with a reason and no traceback).
        task_done_cb: ``cb(task)`` exactly once, when the task has completed.

    Attributes:
        completion_status: How the task ended; None while it is not done.
        client_tasks: One entry per assignment, in the order they were made.
        last_client_task_map: The latest assignment of each client, by client name.
        targets: The clients the task was scheduled for (resolved when scheduled; a relay with
            dynamic targets lists clients as they take their turn); None before scheduling.
        schedule_time: Queue clock reading when the task was scheduled; None before.

    Example:
        >>> task = Task("train", Shareable({"weights": [0.0]}), timeout=600.0)
        >>> task.is_done
        False
    """

    def __init__(
        self,
        name: str,
        data: Shareable,
        props: dict[str, Any] | None = None,
        timeout: float = 0.0,
        before_task_sent_cb: ClientTaskCallback | None = None,
        after_task_sent_cb: ClientTaskCallback | None = None,
        result_received_cb: ClientTaskCallback | None = None,
        task_done_cb: TaskCallback | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"task name must be a non-empty string, got {name!r}")
        if not isinstance(data, Shareable):
            raise TypeError(f"task {name!r}: data must be a Shareable, got {type(data).__name__}")
        if timeout < 0:
            raise ValueError(f"task {name!r}: timeout must be >= 0 seconds (0 = no timeout), got {timeout}")
        self.name = name
        self.data = data
        self.props: dict[str, Any] = {} if props is None else props
        self.timeout = float(timeout)
        self.before_task_sent_cb = before_task_sent_cb
        self.after_task_sent_cb = after_task_sent_cb
        self.result_received_cb = result_received_cb
        self.task_done_cb = task_done_cb
        self.completion_status: TaskCompletionStatus | None = None
        self.client_tasks: list[ClientTask] = []
        self.last_client_task_map: dict[str, ClientTask] = {}
        self.targets: list[str] | None = None
        self.schedule_time: float | None = None
        self._done = threading.Event()

    def __repr__(self) -> str:
        status = None if self.completion_status is None else self.completion_status.value
        return f"Task(name={self.name!r}, status={status}, client_tasks={len(self.client_tasks)})"

    @property
    def is_done(self) -> bool:
        """True once the task has completed and its ``task_done_cb`` has returned."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Block until the task is done or ``timeout_s`` seconds pass; return `is_done`.

        This only waits: time-based rules are applied by the queue's ``check`` (which the
        runtime and the ``*_and_wait`` methods of `Controller` call).
        """
        return self._done.wait(timeout_s)

    def _mark_done(self) -> None:
        self._done.set()


@dataclasses.dataclass(eq=False)
class ClientTask:
    """One assignment of a task to one client.

    Attributes:
        client: Name of the client.
        task: The task it belongs to.
        id: Unique id of this assignment; the client's result must carry it.
        result: The client's result once accepted, else None; a ``result_received_cb`` may
            drop it to free memory (``result_received_time`` still says it arrived).
        status: None while open; ``OK`` when a result with return code OK arrived, ``ERROR``
            when its return code is not OK, a callback raised or delivery failed, ``TIMEOUT``
            when no result came in the time allowed (the relay's ``task_result_timeout``, or
            the task ended: it timed out, or had its results without this one),
            ``CLIENT_DEAD``, or ``CANCELLED`` when the task was cancelled or aborted.
        sent_time: Queue clock reading when the client got the task.
        result_received_time: Queue clock reading when its result was accepted, else None.
        reason: Why it ended with ``ERROR``, ``TIMEOUT`` or ``CLIENT_DEAD``, else None.
    """

    client: str
    task: Task
    id: str
    result: Shareable | None = None
    status: TaskCompletionStatus | None = None
    sent_time: float | None = None
    result_received_time: float | None = None
    reason: str | None = None

    def __repr__(self) -> str:
        status = None if self.status is None else self.status.value
        return f"ClientTask(client={self.client!r}, task={self.task.name!r}, id={self.id!r}, status={status})"


def run_callback(callback: Callable[[Any], None] | None, arg: Any, what: str, task: Task, client: str) -> bool:
    """Call a task callback; log and swallow what it raises (the queue must go on).

    Returns:
        False when the callback raised.
    """
    if callback is None:
        return True
    try:
        callback(arg)
    except Exception:
        logger.exception("%s raised: task=%s client=%s", what, task.name, client)
        return False
    return True
