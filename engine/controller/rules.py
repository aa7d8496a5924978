"""Who may take a task next and when it is finished: one rule per kind of task.

A rule holds the settings of one scheduled task (``min_responses``, ``task_assignment_timeout``
...) and its small state. The `TaskQueue` calls it under its lock, with the queue clock's
reading ``now`` and the set of dead clients, so a rule never locks, sleeps or reads a clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Set

from engine.controller.task import ClientTask, SendOrder, Task, TaskCompletionStatus
from engine.model import ReservedHeaderKey, Shareable


class TaskRule(ABC):
    """Decides, for one task, which client may take it and whether it has completed."""

    def prepare(self, task: Task, targets: list[str]) -> None:  # noqa: B027 - optional hook
        """Set ``task.targets`` when the task is scheduled (``targets`` already resolved)."""
        task.targets = list(targets)

    @abstractmethod
    def may_send(self, task: Task, client: str, dead: Set[str], now: float) -> bool:
        """Whether live ``client``, asking for work, may take ``task`` now."""

    def on_sent(self, client_task: ClientTask, now: float) -> None:  # noqa: B027 - optional hook
        """``client_task`` was just assigned."""

    def on_result(self, client_task: ClientTask) -> None:  # noqa: B027 - optional hook
        """A result was accepted for ``client_task``; ``result_received_cb`` has not run yet."""

    def on_closed(self, client_task: ClientTask, now: float) -> None:  # noqa: B027 - optional hook
        """``client_task`` is over: its result was processed, or it failed, died or timed out."""

    def update(self, task: Task, dead: Set[str], now: float) -> None:  # noqa: B027 - optional hook
        """Apply the rule's own timers (a relay target that took too long) before a decision."""

    @abstractmethod
    def exit_status(self, task: Task, dead: Set[str], now: float) -> TaskCompletionStatus | None:
        """How the task completes now, or None while it goes on."""

    def next_event_time(self, task: Task, now: float) -> float | None:
        """Earliest clock reading after ``now`` at which a decision may change by time alone."""
        return None


def failure_status(task: Task, dead: Set[str]) -> TaskCompletionStatus:
    """Status of a task that cannot get the results it needs any more."""
    if any(ct.status is TaskCompletionStatus.CLIENT_DEAD for ct in task.client_tasks) or any(
        target in dead for target in task.targets or ()
    ):
        return TaskCompletionStatus.CLIENT_DEAD
    if any(ct.status is TaskCompletionStatus.ERROR for ct in task.client_tasks):
        return TaskCompletionStatus.ERROR
    return TaskCompletionStatus.TIMEOUT


def _answered(task: Task) -> bool:
    """Whether a client returned a result (``result`` itself may have been dropped by a callback)."""
    return any(ct.result_received_time is not None for ct in task.client_tasks)


def _next_window_time(opened_at: float, assignment_timeout_s: float, now: float) -> float:
    return opened_at + ((now - opened_at) // assignment_timeout_s + 1) * assignment_timeout_s


def _window(candidates: list[str], opened_at: float, assignment_timeout_s: float, now: float) -> list[str]:
    """The candidates that may take a SEQUENTIAL task now: one more per assignment timeout."""
    if assignment_timeout_s <= 0:
        return candidates[:1]
    return candidates[: int((now - opened_at) // assignment_timeout_s) + 1]


class BroadcastRule(TaskRule):
    """Every target gets the task once; done on ``min_responses`` results plus a grace time.

    Args:
        min_responses: Usable results needed (return code OK and not refused by the
            workflow's result callback); 0 = every target.
        wait_time_after_min_received: Seconds to wait for more results once there are enough;
            the task completes earlier when no target that could still answer is left.
        forever: Never complete (only a cancel, a task timeout or the end of the run ends it);
            a client gets the task again each time it asks once its previous copy is over.
    """

    def __init__(self, min_responses: int = 1, wait_time_after_min_received: float = 0.0, forever: bool = False):
        self.min_responses = min_responses
        self.wait_time_after_min_received = wait_time_after_min_received
        self.forever = forever
        self._min_reached_at: float | None = None
        # Results whose result callback still runs: not usable until it has accepted them, so a
        # site whose result is about to be refused cannot end the task before the others answer.
        self._checking: set[int] = set()

    def on_result(self, client_task: ClientTask) -> None:
        self._checking.add(id(client_task))

    def on_closed(self, client_task: ClientTask, now: float) -> None:
        self._checking.discard(id(client_task))

    def may_send(self, task: Task, client: str, dead: Set[str], now: float) -> bool:
        if client not in (task.targets or ()):
            return False
        last = task.last_client_task_map.get(client)
        return last is None or (self.forever and last.status is not None)

    def exit_status(self, task: Task, dead: Set[str], now: float) -> TaskCompletionStatus | None:
        if self.forever:
            return None
        targets = task.targets or []
        # Only usable results count: an error result, or one the workflow refused, does not.
        responded = sum(
            ct.status is TaskCompletionStatus.OK and id(ct) not in self._checking for ct in task.client_tasks
        )
        required = self.min_responses or len(targets)
        could_answer = sum(
            1
            for target in targets
            if target not in dead
            and (
                target not in task.last_client_task_map
                or task.last_client_task_map[target].status is None
                or id(task.last_client_task_map[target]) in self._checking
            )
        )
        if responded >= required:
            if self._min_reached_at is None:
                self._min_reached_at = now
            if could_answer == 0 or now - self._min_reached_at >= self.wait_time_after_min_received:
                return TaskCompletionStatus.OK
            return None
        if could_answer == 0:
            return failure_status(task, dead)
        return None

    def next_event_time(self, task: Task, now: float) -> float | None:
        if self._min_reached_at is None:
            return None
        return self._min_reached_at + self.wait_time_after_min_received


class SendRule(TaskRule):
    """One target does the task; done (``OK``) when its result arrives.

    Once a target holds the task nobody else gets it. If that assignment fails (delivery
    error, dead client) the task goes to the next target that has not had it.

    Args:
        send_order: ``ANY``: any target may take it. ``SEQUENTIAL``: only the first target in
            order that has not had it and is alive.
        task_assignment_timeout: SEQUENTIAL only: seconds after which, if nobody took the task,
            the next target may take it too (earlier targets stay eligible); 0 = wait for the
            first target. ANY ignores it, as NVIDIA FLARE does.
    """

    def __init__(self, send_order: SendOrder = SendOrder.SEQUENTIAL, task_assignment_timeout: float = 0.0):
        self.send_order = send_order
        self.task_assignment_timeout = task_assignment_timeout
        self._holder: ClientTask | None = None
        self._opened_at = 0.0

    def prepare(self, task: Task, targets: list[str]) -> None:
        super().prepare(task, targets)
        self._opened_at = task.schedule_time or 0.0

    def _candidates(self, task: Task, dead: Set[str]) -> list[str]:
        tried = task.last_client_task_map
        return [t for t in task.targets or () if t not in tried and t not in dead]

    def may_send(self, task: Task, client: str, dead: Set[str], now: float) -> bool:
        if self._holder is not None or _answered(task):
            return False
        candidates = self._candidates(task, dead)
        if self.send_order is SendOrder.ANY:
            return client in candidates
        return client in _window(candidates, self._opened_at, self.task_assignment_timeout, now)

    def on_sent(self, client_task: ClientTask, now: float) -> None:
        self._holder = client_task

    def on_closed(self, client_task: ClientTask, now: float) -> None:
        if client_task is self._holder:
            self._holder = None
            self._opened_at = now

    def exit_status(self, task: Task, dead: Set[str], now: float) -> TaskCompletionStatus | None:
        if _answered(task):
            return TaskCompletionStatus.OK
        if self._holder is None and not self._candidates(task, dead):
            return failure_status(task, dead)
        return None

    def next_event_time(self, task: Task, now: float) -> float | None:
        if self._holder is not None or self.send_order is SendOrder.ANY or self.task_assignment_timeout <= 0:
            return None
        return _next_window_time(self._opened_at, self.task_assignment_timeout, now)


class RelayRule(TaskRule):
    """Targets take the task one after another, each getting the previous target's result.

    When a target's result is accepted with return code OK, it becomes the task's data (a
    shallow copy without the return code) before ``result_received_cb`` runs, so the callback
    may still replace ``task.data``. The next target's turn opens once the callback returned.
    Completes ``OK`` when every target has had its turn and at least one returned a result.

    Args:
        send_order: ``SEQUENTIAL``: targets in list order, a dead one skipped. ``ANY``: the next
            turn goes to whichever target that has not had one asks first.
        task_assignment_timeout: SEQUENTIAL only: seconds a turn waits for its target to ask
            before the next target may take it; when all remaining targets let it pass, the
            relay ends. 0 = wait for the target.
        task_result_timeout: Seconds a target may hold the task without returning a result
            before its client task ends with ``TIMEOUT`` and the turn moves on; 0 = no limit.
        dynamic_targets: The targets (every client) take their turns in the order they ask,
            and ``task.targets`` lists them as they do; `Controller.relay` sets it only for
            targets None.
    """

    def __init__(
        self,
        send_order: SendOrder = SendOrder.SEQUENTIAL,
        task_assignment_timeout: float = 0.0,
        task_result_timeout: float = 0.0,
        dynamic_targets: bool = False,
    ):
        self.send_order = send_order
        self.task_assignment_timeout = task_assignment_timeout
        self.task_result_timeout = task_result_timeout
        self.dynamic_targets = dynamic_targets
        self._pool: list[str] = []
        self._holder: ClientTask | None = None
        self._next_index = 0
        self._opened_at = 0.0

    def prepare(self, task: Task, targets: list[str]) -> None:
        task.targets = [] if self.dynamic_targets else list(targets)
        self._pool = list(targets)
        self._opened_at = task.schedule_time or 0.0

    @property
    def _in_order(self) -> bool:
        return self.send_order is SendOrder.SEQUENTIAL and not self.dynamic_targets

    def _candidates(self, task: Task, dead: Set[str]) -> list[str]:
        if self._in_order:
            return [t for t in (task.targets or [])[self._next_index :] if t not in dead]
        return [t for t in self._pool if t not in task.last_client_task_map and t not in dead]

    def may_send(self, task: Task, client: str, dead: Set[str], now: float) -> bool:
        if self._holder is not None:
            return False
        candidates = self._candidates(task, dead)
        if not self._in_order:
            return client in candidates
        return client in _window(candidates, self._opened_at, self.task_assignment_timeout, now)

    def on_sent(self, client_task: ClientTask, now: float) -> None:
        self._holder = client_task
        task = client_task.task
        if self._in_order:
            self._next_index = task.targets.index(client_task.client, self._next_index) + 1
        elif self.dynamic_targets:
            task.targets.append(client_task.client)

    def on_result(self, client_task: ClientTask) -> None:
        if client_task.status is TaskCompletionStatus.OK and client_task.result is not None:
            client_task.task.data = _passed_on(client_task.result)

    def on_closed(self, client_task: ClientTask, now: float) -> None:
        if client_task is self._holder:
            self._holder = None
            self._opened_at = now

    def update(self, task: Task, dead: Set[str], now: float) -> None:
        holder = self._holder
        if holder is None or self.task_result_timeout <= 0 or holder.status is not None:
            return
        deadline = (holder.sent_time or 0.0) + self.task_result_timeout
        if now >= deadline:
            holder.status = TaskCompletionStatus.TIMEOUT
            holder.reason = f"no result within task_result_timeout={self.task_result_timeout} s"
            self.on_closed(holder, deadline)

    def exit_status(self, task: Task, dead: Set[str], now: float) -> TaskCompletionStatus | None:
        if self._holder is not None:
            return None
        candidates = self._candidates(task, dead)
        gave_up = (
            self._in_order
            and self.task_assignment_timeout > 0
            and now - self._opened_at >= len(candidates) * self.task_assignment_timeout
        )
        if candidates and not gave_up:
            return None
        if _answered(task):
            return TaskCompletionStatus.OK
        return failure_status(task, dead)

    def next_event_time(self, task: Task, now: float) -> float | None:
        holder = self._holder
        if holder is not None:
            if self.task_result_timeout <= 0 or holder.status is not None:
                return None
            return (holder.sent_time or 0.0) + self.task_result_timeout
        if not self._in_order or self.task_assignment_timeout <= 0:
            return None
        return _next_window_time(self._opened_at, self.task_assignment_timeout, now)


def _passed_on(result: Shareable) -> Shareable:
    data = shallow_copy(result)
    data.headers.pop(ReservedHeaderKey.RETURN_CODE, None)
    return data


def shallow_copy(data: Shareable) -> Shareable:
    """A new `Shareable` holding the same values (tensors are shared, never copied).

    Its headers are a copy too, so setting a header on it leaves ``data`` alone.
    """
    headers = data.headers
    copy = Shareable({key: value for key, value in data.items() if value is not headers})
    for key, value in headers.items():
        copy.set_header(key, value)
    return copy
