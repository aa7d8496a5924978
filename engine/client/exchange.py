"""`TaskExchange`: the mailbox between an executor and the training script it runs.

The executor puts one task at a time and waits for its result; the script takes the task and
puts the result. It is the whole in-process Client API, and the executor's half of the
subprocess one (a cell handler takes tasks and puts results on the script's behalf).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from engine.errors import FlengineError
from engine.model import FLModel

log = logging.getLogger(__name__)


class ClientAPIError(FlengineError):
    """The Client API was used out of order, or the other side went away."""

    exit_code = 1


@dataclass(frozen=True)
class TaskItem:
    """A task handed to the script: its name and the model it carries."""

    task_name: str
    model: FLModel


class TaskExchange:
    """One task at a time between an executor (``put_task`` / ``take_result``) and a script."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._task: TaskItem | None = None
        self._current: TaskItem | None = None
        self._result: FLModel | None = None
        self._ended = False
        self._abandoned = False

    @property
    def ended(self) -> bool:
        """True once `end` was called: the script should stop."""
        return self._ended

    @property
    def current_task(self) -> TaskItem | None:
        """The task the script took last and has not answered yet."""
        return self._current

    # ----------------------------------------------------------------- executor side

    def put_task(self, task_name: str, model: FLModel) -> None:
        """Offer a task to the script (the previous one must be answered or abandoned)."""
        with self._lock:
            if self._ended:
                raise ClientAPIError("the task exchange has ended; no more tasks can be given")
            self._task, self._result = TaskItem(task_name, model), None
            self._lock.notify_all()

    def take_result(self, timeout_s: float) -> FLModel | None:
        """Wait up to ``timeout_s`` for the script's result; None when none came yet."""
        with self._lock:
            self._lock.wait_for(lambda: self._result is not None or self._ended, timeout_s)
            result, self._result = self._result, None
            return result

    def abandon(self) -> None:
        """Forget the offered task and any result (the task was aborted or timed out)."""
        with self._lock:
            self._abandoned = self._current is not None
            self._task = self._current = self._result = None

    def end(self) -> None:
        """No more tasks: wake the script so it sees that the run is over."""
        with self._lock:
            self._ended = True
            self._task = None
            self._lock.notify_all()

    # ----------------------------------------------------------------- script side

    def take_task(self, timeout_s: float | None) -> TaskItem | None:
        """Wait for a task; None when the run ended or ``timeout_s`` passed first."""
        with self._lock:
            self._lock.wait_for(lambda: self._task is not None or self._ended, timeout_s)
            task, self._task = self._task, None
            if task is not None:
                self._current, self._abandoned = task, False
            return task

    def put_result(self, model: FLModel) -> None:
        """Answer the task taken last (the answer to an abandoned task is dropped)."""
        with self._lock:
            if self._current is None and self._abandoned:
                self._abandoned = False
                log.warning("a result came for a task that was abandoned (timed out or aborted); dropped")
                return
            if self._current is None:
                raise ClientAPIError("send() without a task: call receive() first and send one result per task")
            self._current, self._result = None, model
            self._lock.notify_all()
