"""`TaskExchange`: the mailbox between an executor and the training script it runs.

The executor puts one task at a time and waits for its result; the script takes the task and
puts the result. It is the whole in-process Client API, and the executor's half of the
subprocess one (a cell handler takes tasks and puts results on the script's behalf).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from engine.errors import ClientAPIError
from engine.model import FLModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskItem:
    """A task handed to the script: its name and the model it carries."""

    task_name: str
    model: FLModel


class TaskExchange:
    """One task at a time between an executor (``put_task`` / ``take_result``) and a script.

    While the script waits in `take_task` the executor can see it (`claim_taker`), and what it
    wants the task's weights in (``into``): the executor then receives the task straight into
    those tensors, and the script keeps waiting, even past its timeout, until that task comes.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._task: TaskItem | None = None
        self._current: TaskItem | None = None
        self._result: FLModel | None = None
        self._ended = False
        self._abandoned = False
        self._taker_waiting = False  # the script is inside take_task
        self._taker_into: dict[str, Any] | None = None  # ... and wants the task in these tensors
        self._claimed = False  # the executor is receiving a task into them: no timeout now
        self._droppable = False  # the current task's params are the executor's alone

    @property
    def ended(self) -> bool:
        """True once `end` was called: the script should stop."""
        return self._ended

    @property
    def current_task(self) -> TaskItem | None:
        """The task the script took last and has not answered yet."""
        return self._current

    # ----------------------------------------------------------------- executor side

    def put_task(self, task_name: str, model: FLModel, droppable: bool = False) -> None:
        """Offer a task to the script (the previous one must be answered or abandoned).

        Args:
            task_name: The task's name.
            model: Its model.
            droppable: Nothing but the executor holds ``model``'s params (a copy it made for a
                script in another process), so `drop_task_params` may empty them.
        """
        with self._lock:
            if self._ended:
                raise ClientAPIError("the task exchange has ended; no more tasks can be given")
            self._task, self._result = TaskItem(task_name, model), None
            self._droppable, self._claimed = droppable, False
            self._lock.notify_all()

    def claim_taker(self, timeout_s: float) -> tuple[bool, dict[str, Any] | None]:
        """Wait up to ``timeout_s`` for the script to wait for a task; see what it wants it in.

        Returns:
            Whether the script is waiting, and the tensors it passed as ``into`` (None without).
            With tensors, the script now waits for the next task whatever its timeout, until
            `put_task`, `release_claim`, `abandon` or `end`: the executor may write into them.
        """
        with self._lock:
            waiting = self._lock.wait_for(lambda: self._taker_waiting or self._ended, timeout_s)
            if not waiting or self._ended or not self._taker_waiting:
                return False, None
            into = self._taker_into
            self._claimed = into is not None
            return True, into

    def release_claim(self) -> None:
        """Let the script's timeout count again (no task comes into its tensors after all)."""
        with self._lock:
            self._claimed = False
            self._lock.notify_all()

    def drop_task_params(self) -> None:
        """Empty the current task's params where `put_task` was told they are droppable.

        A script in another process has its own copy once it asks to send; the executor's copy
        goes back to the tensor pool before the result's tensors arrive, so the client holds one
        model, not two.
        """
        with self._lock:
            current = self._current
            if current is None or not self._droppable:
                return
            self._droppable = False
            params, current.model.params = current.model.params, None
        if isinstance(params, dict):
            params.clear()  # the same dict may sit in the task data (a DXO's), held by the caller

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
            self._claimed = False
            self._lock.notify_all()

    def end(self) -> None:
        """No more tasks: wake the script so it sees that the run is over."""
        with self._lock:
            self._ended = True
            self._task = None
            self._claimed = False
            self._lock.notify_all()

    # ----------------------------------------------------------------- script side

    def take_task(self, timeout_s: float | None, into: dict[str, Any] | None = None) -> TaskItem | None:
        """Wait for a task; None when the run ended or ``timeout_s`` passed first.

        Args:
            timeout_s: Seconds to wait; None: until a task comes or the run ends.
            into: Tensors by name the script wants the task's weights in (see `claim_taker`).
        """
        with self._lock:
            self._taker_waiting, self._taker_into = True, into
            self._lock.notify_all()
            try:
                arrived = lambda: self._task is not None or self._ended  # noqa: E731
                self._lock.wait_for(arrived, timeout_s)
                self._lock.wait_for(lambda: arrived() or not self._claimed)  # a task is coming into `into`
                task, self._task = self._task, None
                if task is not None:
                    self._current, self._abandoned = task, False
                return task
            finally:
                self._taker_waiting, self._taker_into = False, None

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
