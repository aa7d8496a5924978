"""`Controller`: the base class of server workflows, with the broadcast / send / relay API."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

from engine.controller.context import JobContext
from engine.controller.queue import TaskQueue
from engine.controller.rules import BroadcastRule, RelayRule, SendRule, TaskRule
from engine.controller.task import SendOrder, Task, TaskCompletionStatus
from engine.model import Shareable

logger = logging.getLogger(__name__)

#: Longest a ``*_and_wait`` call sleeps before it looks at its abort signals again (seconds).
ABORT_CHECK_INTERVAL_S = 0.1


class Controller(ABC):
    """Base of workflows: schedule tasks for clients and wait for their results.

    The runtime builds the workflow, calls `bind` with the run's task queue, then `run`.
    Subclasses that define ``__init__`` call ``super().__init__()``.

    Attributes:
        abort_signal: Set when the job is aborted; long loops in `run` should look at it.
        context: The job around the workflow (components, workspace, progress reports).
        resumable: Whether the workflow resumes from its checkpoint when its job runs again after
            the server stopped (``context.resuming``); a job whose unfinished workflow cannot
            ends FINISHED_ABORTED with the reason instead.
        needs_live_clients: Whether the workflow's clients work together at the same time (a
            client-controlled workflow such as Swarm): it cannot run on the virtual clients of
            ``flengine run -t``, which a worker runs one at a time.
        status_workflow: The name of the clients' status reports the workflow follows (a
            client-controlled workflow's task name prefix, see `JobContext.client_status`); None:
            it follows none. The runtime keeps only the reports of its workflows' names.

    Example:
        >>> class OneRound(Controller):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.results: dict[str, Shareable] = {}
        ...
        ...     def run(self) -> None:
        ...         task = Task("train", Shareable(), timeout=600.0, result_received_cb=self.collect)
        ...         self.broadcast_and_wait(task, min_responses=0)
        ...
        ...     def collect(self, client_task: ClientTask) -> None:
        ...         self.results[client_task.client] = client_task.result
    """

    resumable: bool = False
    needs_live_clients: bool = False
    status_workflow: str | None = None

    def __init__(self) -> None:
        self._queue: TaskQueue | None = None
        self.abort_signal = threading.Event()
        self.context = JobContext()

    def bind(
        self,
        queue: TaskQueue,
        abort_signal: threading.Event | None = None,
        context: JobContext | None = None,
    ) -> None:
        """Attach the workflow to the run's task queue; the runtime calls it before `run`.

        Args:
            queue: The run's task queue; its late results come to `process_result_of_unknown_task`.
            abort_signal: The job's abort signal (a fresh one when None).
            context: The job around the workflow (an empty one when None).
        """
        self._queue = queue
        self.abort_signal = abort_signal if abort_signal is not None else threading.Event()
        self.context = context if context is not None else JobContext()
        queue.set_late_result_handler(self.process_result_of_unknown_task)

    @abstractmethod
    def run(self) -> None:
        """The workflow: schedule tasks and use their results until done."""

    # -- scheduling ---------------------------------------------------------------------------------

    def broadcast(
        self,
        task: Task,
        targets: list[str] | None = None,
        min_responses: int = 1,
        wait_time_after_min_received: float = 0.0,
    ) -> None:
        """Give ``task`` to every target once; return at once.

        Args:
            task: A task not scheduled before.
            targets: Client names; None = every client.
            min_responses: Usable results (return code OK, not refused) after which the task may
                complete; 0 = every target.
            wait_time_after_min_received: Seconds to wait for more results once
                ``min_responses`` are in (it completes earlier when every target answered).

        Raises:
            ValueError: A target is unknown or repeated, ``min_responses`` is more than the
                targets, a number is negative, or the task was scheduled before.
        """
        resolved = self._resolve_targets(task, targets)
        if min_responses < 0 or min_responses > len(resolved):
            raise ValueError(
                f"task {task.name!r}: min_responses={min_responses} must be 0..{len(resolved)} "
                f"(the number of targets; 0 = all)"
            )
        _check_seconds(task, "wait_time_after_min_received", wait_time_after_min_received)
        self._schedule(task, resolved, BroadcastRule(min_responses, wait_time_after_min_received))

    def broadcast_and_wait(
        self,
        task: Task,
        targets: list[str] | None = None,
        min_responses: int = 1,
        wait_time_after_min_received: float = 0.0,
        abort_signal: threading.Event | None = None,
    ) -> None:
        """`broadcast`, then wait until the task is done or aborted (see `wait_for_task`)."""
        self.broadcast(task, targets, min_responses, wait_time_after_min_received)
        self.wait_for_task(task, abort_signal)

    def broadcast_forever(self, task: Task, targets: list[str] | None = None) -> None:
        """Give ``task`` to every target, again each time one asks after finishing it.

        It never completes on its own: cancel it, or let its timeout or the end of the run end it.
        """
        self._schedule(task, self._resolve_targets(task, targets), BroadcastRule(forever=True))

    def send(
        self,
        task: Task,
        targets: list[str] | None = None,
        send_order: SendOrder = SendOrder.SEQUENTIAL,
        task_assignment_timeout: float = 0.0,
    ) -> None:
        """Give ``task`` to one of the targets; it completes when that one's result arrives.

        Args:
            task: A task not scheduled before.
            targets: Candidate clients; None = every client.
            send_order: ``SEQUENTIAL``: the first live target in order that has not had it;
                ``ANY``: whichever target asks first.
            task_assignment_timeout: SEQUENTIAL only: seconds to wait for a target to ask
                before the next one may take the task too; 0 = wait for the first.
        """
        _check_seconds(task, "task_assignment_timeout", task_assignment_timeout)
        resolved = self._resolve_targets(task, targets)
        self._schedule(task, resolved, SendRule(SendOrder(send_order), task_assignment_timeout))

    def send_and_wait(
        self,
        task: Task,
        targets: list[str] | None = None,
        send_order: SendOrder = SendOrder.SEQUENTIAL,
        task_assignment_timeout: float = 0.0,
        abort_signal: threading.Event | None = None,
    ) -> None:
        """`send`, then wait until the task is done or aborted (see `wait_for_task`)."""
        self.send(task, targets, send_order, task_assignment_timeout)
        self.wait_for_task(task, abort_signal)

    def relay(
        self,
        task: Task,
        targets: list[str] | None = None,
        send_order: SendOrder = SendOrder.SEQUENTIAL,
        task_assignment_timeout: float = 0.0,
        task_result_timeout: float = 0.0,
        dynamic_targets: bool = True,
    ) -> None:
        """Give ``task`` to the targets one after another, each getting the previous result.

        A result with return code OK becomes ``task.data`` for the next target (the
        ``result_received_cb`` may replace it). The task completes ``OK`` when every target
        has had its turn and at least one answered.

        Args:
            task: A task not scheduled before.
            targets: Clients in relay order; None = every client.
            send_order: ``SEQUENTIAL``: in target order; ``ANY``: whoever asks first next.
            task_assignment_timeout: SEQUENTIAL only: seconds a turn waits for its target to
                ask before the next target may take it; 0 = wait.
            task_result_timeout: Seconds a target may hold the task before the turn moves
                on without its result; 0 = no limit.
            dynamic_targets: With targets None: True = clients in the order they ask;
                False = clients in the run's order. Ignored when targets are given.
        """
        _check_seconds(task, "task_assignment_timeout", task_assignment_timeout)
        _check_seconds(task, "task_result_timeout", task_result_timeout)
        resolved = self._resolve_targets(task, targets)
        rule = RelayRule(
            SendOrder(send_order),
            task_assignment_timeout,
            task_result_timeout,
            dynamic_targets=dynamic_targets and targets is None,
        )
        self._schedule(task, resolved, rule)

    def relay_and_wait(
        self,
        task: Task,
        targets: list[str] | None = None,
        send_order: SendOrder = SendOrder.SEQUENTIAL,
        task_assignment_timeout: float = 0.0,
        task_result_timeout: float = 0.0,
        dynamic_targets: bool = True,
        abort_signal: threading.Event | None = None,
    ) -> None:
        """`relay`, then wait until the task is done or aborted (see `wait_for_task`)."""
        self.relay(task, targets, send_order, task_assignment_timeout, task_result_timeout, dynamic_targets)
        self.wait_for_task(task, abort_signal)

    def wait_for_task(self, task: Task, abort_signal: threading.Event | None = None) -> None:
        """Wait until ``task`` is done, or cancel it with ``ABORTED`` once an abort signal is set.

        Both ``abort_signal`` and the workflow's own `abort_signal` are watched. While it waits
        it applies the queue's time-based rules itself, so it needs no outside timer.
        """
        queue = self._bound_queue()
        signals = [s for s in (abort_signal, self.abort_signal) if s is not None]
        while not task.is_done:
            if any(signal.is_set() for signal in signals):
                logger.info("task aborted while waiting: task=%s", task.name)
                queue.cancel(task, TaskCompletionStatus.ABORTED)
                return
            queue.check()
            task.wait(queue.next_check_in_s(ABORT_CHECK_INTERVAL_S))

    def cancel_task(self, task: Task, completion_status: TaskCompletionStatus = TaskCompletionStatus.CANCELLED) -> None:
        """Complete ``task`` now with ``completion_status``; nothing happens if it is done."""
        self._bound_queue().cancel(task, completion_status)

    def cancel_all_tasks(self, completion_status: TaskCompletionStatus = TaskCompletionStatus.CANCELLED) -> None:
        """Complete every outstanding task now with ``completion_status``."""
        self._bound_queue().cancel_all(completion_status)

    def process_result_of_unknown_task(self, client: str, task_name: str, task_id: str, result: Shareable) -> None:
        """Handle a result that no live task expects (late, or for a task that ended).

        The default logs it and drops it; override to make use of late results handed to the
        queue. The server runtime itself refuses such results before it pulls them (a site
        cannot make the server download data that no task asked for), so over the network
        this is not called.
        """
        logger.warning("late result from client=%s task_name=%s task_id=%s ignored", client, task_name, task_id)

    def get_clients(self) -> list[str]:
        """Names of the run's clients."""
        return self._bound_queue().clients

    # -- helpers ------------------------------------------------------------------------------------

    def _bound_queue(self) -> TaskQueue:
        queue = getattr(self, "_queue", None)
        if queue is None:
            raise RuntimeError(
                f"{type(self).__name__} is not bound to a task queue: the runtime calls bind() before run()"
            )
        return queue

    def _resolve_targets(self, task: Task, targets: list[str] | None) -> list[str]:
        clients = self._bound_queue().clients
        if targets is None:
            if not clients:
                raise ValueError(f"task {task.name!r}: the run has no clients to send it to")
            return clients
        if isinstance(targets, str):
            raise TypeError(f"task {task.name!r}: targets must be a list of client names, got the string {targets!r}")
        resolved = list(targets)
        if not resolved:
            raise ValueError(f"task {task.name!r}: targets is empty; pass None for every client")
        unknown = [t for t in resolved if t not in clients]
        if unknown:
            raise ValueError(f"task {task.name!r}: unknown client(s) {unknown} in targets; known clients: {clients}")
        repeated = sorted({t for t in resolved if resolved.count(t) > 1})
        if repeated:
            raise ValueError(f"task {task.name!r}: client(s) {repeated} named more than once in targets")
        return resolved

    def _schedule(self, task: Task, targets: list[str], rule: TaskRule) -> None:
        self._bound_queue().schedule(task, targets, rule)


def _check_seconds(task: Task, name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"task {task.name!r}: {name} must be >= 0 seconds, got {value}")
