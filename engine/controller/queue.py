"""`TaskQueue`: the tasks of a run, handed to clients as they ask and completed by their rules.

The runtime drives it from several threads: a client's task request calls `TaskQueue.next_task`,
its result calls `TaskQueue.submit`, a lost connection calls `TaskQueue.client_dead`, and a
timer calls `TaskQueue.check` about every 0.2 s. Workflows schedule through `Controller`.

All state changes happen under one lock; task callbacks run outside it, in the calling thread,
because they may take long (aggregation runs in ``result_received_cb``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from enum import Enum
from typing import Any

from engine.controller.rules import BroadcastRule, TaskRule, shallow_copy
from engine.controller.task import ClientTask, Task, TaskCompletionStatus, run_callback
from engine.errors import ResultRefused
from engine.model import ReservedHeaderKey, ReturnCode, Shareable

logger = logging.getLogger(__name__)

LateResultHandler = Callable[[str, str, str, Shareable], None]


#: `Task.props` key of a workflow's *result receiver*, ``receiver(header, client) -> sink | None``:
#: the runtime calls it with a result rebuilt before its tensors are pulled (tensors as
#: placeholders) and, given a sink, hands it the tensors one at a time as they arrive (a
#: workflow folding results into a sum). The sink's ``fail(reason)`` is called when the result
#: does not reach the task after all.
RESULT_RECEIVER_PROP = "result_receiver"


class SubmitOutcome(str, Enum):
    """What `TaskQueue.submit` did with a result."""

    ACCEPTED = "ACCEPTED"
    LATE = "LATE"
    DUPLICATE = "DUPLICATE"


@dataclasses.dataclass(frozen=True)
class TaskAssignment:
    """A task handed to one client: what the runtime sends it.

    Attributes:
        task_name: Name of the task.
        task_id: Id of the client task; the client's result must carry it.
        data: The client's own shallow copy of the task data, headers ``TASK_NAME`` and
            ``TASK_ID`` set.
        client_task: The assignment's bookkeeping entry.
    """

    task_name: str
    task_id: str
    data: Shareable
    client_task: ClientTask


@dataclasses.dataclass(eq=False)
class _Entry:
    """A scheduled task with its rule and the state of its callbacks."""

    task: Task
    rule: TaskRule
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    result_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    results_in_flight: int = 0
    completed: bool = False
    finishing: bool = False


class TaskQueue:
    """Thread-safe queue of the scheduled tasks of one run.

    Args:
        clients: Names of the clients of the run.
        clock: Monotonic clock in seconds; tests pass a fake one.
    """

    def __init__(self, clients: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        names = list(clients)
        if len(set(names)) != len(names):
            raise ValueError(f"client names must be unique, got {names}")
        self._clients = names
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._by_task: dict[Task, _Entry] = {}
        self._open: dict[str, tuple[_Entry, ClientTask]] = {}  # client task id -> its live task
        self._dead: set[str] = set()
        self._ended = False
        self._late_result_handler: LateResultHandler | None = None
        self._schedule_listener: Callable[[list[str]], None] | None = None

    @property
    def clients(self) -> list[str]:
        """Names of the clients of the run, in the order given."""
        return list(self._clients)

    @property
    def ended(self) -> bool:
        """True after `end_run`: clients are to be told to end."""
        return self._ended

    def set_late_result_handler(self, handler: LateResultHandler | None) -> None:
        """Call ``handler(client, task_name, task_id, result)`` for each late result."""
        self._late_result_handler = handler

    def set_schedule_listener(self, listener: Callable[[list[str]], None] | None) -> None:
        """Call ``listener(targets)`` after each task is scheduled (the server tells those clients)."""
        self._schedule_listener = listener

    def pending_tasks(self) -> list[Task]:
        """The tasks scheduled and not yet completed, in queue order."""
        with self._lock:
            return [entry.task for entry in self._entries]

    def schedule(self, task: Task, targets: list[str], rule: TaskRule) -> None:
        """Append ``task`` to the queue; ``rule`` decides who gets it and when it is done.

        Args:
            task: A task never scheduled before.
            targets: Known client names, already checked by the caller.
            rule: The rule of this task's kind (broadcast, send, relay).

        Raises:
            ValueError: The task object was scheduled before.
            RuntimeError: The run has ended.
        """
        with self._lock:
            if self._ended:
                raise RuntimeError(f"cannot schedule task {task.name!r}: the run has ended")
            if task.schedule_time is not None:  # a Task runs once, in one queue
                raise ValueError(f"task {task.name!r} was already scheduled; create a new Task for each use")
            task.schedule_time = self._clock()
            rule.prepare(task, targets)
            entry = _Entry(task, rule)
            self._entries.append(entry)
            self._by_task[task] = entry
            logger.debug("task scheduled: task=%s targets=%s", task.name, task.targets)
            finished = self._sweep_locked(task.schedule_time)
        self._finish(finished)
        listener = self._schedule_listener
        if listener is not None:
            try:
                listener(list(targets))
            except Exception:  # a client not told asks again after its retry time anyway
                logger.warning("schedule listener failed: task=%s", task.name, exc_info=True)

    def next_task(self, client: str) -> TaskAssignment | None:
        """Give ``client`` the first task in queue order it may take, or None: try again later.

        A dead client, an unknown one and every client after `end_run` get None.
        """
        with self._lock:
            now = self._clock()
            finished = self._sweep_locked(now)
            picked = None
            if self._ended or client in self._dead:
                pass
            elif client not in self._clients:
                logger.warning("task request from an unknown client ignored: client=%s", client)
            else:
                picked = self._pick_locked(client, now)
        self._finish(finished)
        return None if picked is None else self._deliver(*picked)

    def clients_with_work(self, candidates: Collection[str]) -> list[str]:
        """Those of ``candidates`` that `next_task` would give a task now (a simulation's worker asks for its clients).

        Nothing is assigned: each client still asks for its task itself.
        """
        wanted = set(candidates)
        found: dict[str, None] = {}
        with self._lock:
            if self._ended:
                return []
            now = self._clock()
            for entry in self._entries:
                targets = entry.task.targets or wanted
                for client in targets:
                    if client in wanted and client not in found and client not in self._dead:
                        if entry.rule.may_send(entry.task, client, self._dead, now):
                            found[client] = None
        return list(found)

    def result_receiver(self, client: str, task_id: str) -> Callable[..., Any] | None:
        """The workflow's result receiver of ``client``'s open client task ``task_id`` (see `RESULT_RECEIVER_PROP`)."""
        with self._lock:
            entry, client_task = self._open.get(task_id, (None, None))
            if entry is None or client_task.client != client:
                return None
            return entry.task.props.get(RESULT_RECEIVER_PROP)

    def expects_result(self, client: str, task_id: str) -> SubmitOutcome:
        """Whether ``client``'s result of client task ``task_id`` would be taken, asked before it is received.

        Returns:
            ``ACCEPTED`` while the client task is open and waiting for its result;
            ``DUPLICATE`` once its result was taken; ``LATE`` when no such client task of
            ``client`` is open (never given to it, or ended).
        """
        with self._lock:
            entry, client_task = self._open.get(task_id, (None, None))
            if entry is None or client_task.client != client:
                return SubmitOutcome.LATE
            if client_task.result_received_time is not None:
                return SubmitOutcome.DUPLICATE
            if client_task.status is not None:
                return SubmitOutcome.LATE
            return SubmitOutcome.ACCEPTED

    def submit(self, client: str, task_id: str, result: Shareable) -> SubmitOutcome:
        """Take ``client``'s result of client task ``task_id``.

        ``result_received_cb`` runs in this thread before it returns. A result for no live
        client task goes to the late-result handler and never to a task.
        """
        with self._lock:
            entry, client_task = self._open.get(task_id, (None, None))
            if entry is None or client_task.client != client:
                outcome = SubmitOutcome.LATE
            elif client_task.result_received_time is not None:
                outcome = SubmitOutcome.DUPLICATE
            elif client_task.status is not None:  # timed out, failed or dead: too late
                outcome = SubmitOutcome.LATE
            else:
                outcome = SubmitOutcome.ACCEPTED
                self._accept_locked(entry, client_task, result)
        if outcome is SubmitOutcome.LATE:
            self._report_late(client, task_id, result)
            return outcome
        if outcome is SubmitOutcome.DUPLICATE:
            logger.info("duplicate result ignored: client=%s task_id=%s", client, task_id)
            return outcome
        task = client_task.task
        with entry.result_lock:
            refused = _run_result_callback(task, client_task)
        with self._lock:
            if refused is not None:
                client_task.status = TaskCompletionStatus.ERROR
                client_task.reason = refused
            entry.results_in_flight -= 1
            now = self._clock()
            entry.rule.on_closed(client_task, now)
            finished = self._sweep_locked(now)
            if entry.completed and entry.results_in_flight == 0 and not entry.finishing:
                entry.finishing = True
                finished.append(entry)
        self._finish(finished)
        return outcome

    def fail_client_task(self, client: str, task_id: str, reason: str) -> bool:
        """End ``client``'s open client task ``task_id`` with ``ERROR`` (filter or delivery failed).

        Returns:
            False when no such open client task exists.
        """
        with self._lock:
            found = self._open.get(task_id)
            closed = found is not None and found[1].client == client and found[1].status is None
            if closed:
                entry, client_task = found
                self._close_locked(entry, client_task, TaskCompletionStatus.ERROR, reason)
                logger.warning("client task failed: task=%s client=%s reason=%s", entry.task.name, client, reason)
            finished = self._sweep_locked(self._clock())
        self._finish(finished)
        return closed

    def client_dead(self, client: str) -> None:
        """``client`` is gone: its open client tasks end ``CLIENT_DEAD`` and it gets no more tasks."""
        with self._lock:
            if client not in self._clients:
                logger.warning("unknown client reported dead, ignored: client=%s", client)
                return
            self._dead.add(client)
            for entry, client_task in list(self._open.values()):
                if client_task.client == client and client_task.status is None:
                    self._close_locked(entry, client_task, TaskCompletionStatus.CLIENT_DEAD, "client is dead")
            finished = self._sweep_locked(self._clock())
        logger.warning("client dead: client=%s", client)
        self._finish(finished)

    def can_do_without(self, task_id: str, clients: set[str]) -> bool:
        """Whether the task of client task ``task_id`` can still get the results it needs without ``clients``.

        True when enough of its other targets remain for its ``min_responses`` (a broadcast); False
        for any other kind of task, or one no longer open.
        """
        with self._lock:
            entry, _ = self._open.get(task_id, (None, None))
            if entry is None or not isinstance(entry.rule, BroadcastRule):
                return False
            targets = list(entry.task.targets or [])
            required = entry.rule.min_responses or len(targets)
            return len([target for target in targets if target not in clients]) >= required

    def client_back(self, client: str) -> bool:
        """``client``, once found dead, is alive again (its process was restarted): it may take new tasks.

        Its client tasks that ended ``CLIENT_DEAD`` stay ended; a result of theirs is late.

        Returns:
            True when ``client`` was dead.
        """
        with self._lock:
            back = client in self._dead
            self._dead.discard(client)
        if back:
            logger.warning("client back: client=%s", client)
        return back

    def dead_clients(self) -> set[str]:
        """The clients found dead and not back."""
        with self._lock:
            return set(self._dead)

    def check(self) -> None:
        """Apply the time-based rules: task timeouts, waits after min responses, turn timeouts."""
        with self._lock:
            finished = self._sweep_locked(self._clock())
        self._finish(finished)

    def next_check_in_s(self, limit_s: float) -> float:
        """Seconds until a time-based rule may change something, at most ``limit_s``."""
        with self._lock:
            now = self._clock()
            times = [entry.rule.next_event_time(entry.task, now) for entry in self._entries]
            times += [e.task.schedule_time + e.task.timeout for e in self._entries if e.task.timeout > 0]
        due = [t - now for t in times if t is not None]
        return max(0.0, min([limit_s, *due]))

    def cancel(self, task: Task, status: TaskCompletionStatus = TaskCompletionStatus.CANCELLED) -> bool:
        """Complete ``task`` now with ``status``; False when it is not in the queue."""
        with self._lock:
            entry = self._by_task.get(task)
            finished = [] if entry is None else self._complete_locked(entry, status)
        self._finish(finished)
        return entry is not None

    def cancel_all(self, status: TaskCompletionStatus = TaskCompletionStatus.CANCELLED) -> None:
        """Complete every task in the queue with ``status``."""
        with self._lock:
            finished = [e for entry in list(self._entries) for e in self._complete_locked(entry, status)]
        self._finish(finished)

    def end_run(self) -> None:
        """End the run: outstanding tasks complete ``ABORTED`` and clients get no more tasks."""
        with self._lock:
            self._ended = True
        logger.info("run ended: outstanding tasks aborted")
        self.cancel_all(TaskCompletionStatus.ABORTED)

    # -- under the lock ---------------------------------------------------------------------------

    def _pick_locked(self, client: str, now: float) -> tuple[_Entry, ClientTask] | None:
        for entry in self._entries:
            task = entry.task
            if not entry.rule.may_send(task, client, self._dead, now):
                continue
            client_task = ClientTask(client=client, task=task, id=uuid.uuid4().hex, sent_time=now)
            task.client_tasks.append(client_task)
            task.last_client_task_map[client] = client_task
            self._open[client_task.id] = (entry, client_task)
            entry.rule.on_sent(client_task, now)
            return entry, client_task
        return None

    def _accept_locked(self, entry: _Entry, client_task: ClientTask, result: Shareable) -> None:
        client_task.result = result
        client_task.result_received_time = self._clock()
        try:
            code = result.get_return_code()
        except ValueError:
            code = None
        if code is ReturnCode.OK:
            client_task.status = TaskCompletionStatus.OK
        else:
            client_task.status = TaskCompletionStatus.ERROR
            client_task.reason = f"return code {result.get_header(ReservedHeaderKey.RETURN_CODE)}"
        entry.results_in_flight += 1
        entry.rule.on_result(client_task)

    def _close_locked(self, entry: _Entry, client_task: ClientTask, status: TaskCompletionStatus, reason: str) -> None:
        client_task.status = status
        client_task.reason = reason
        entry.rule.on_closed(client_task, self._clock())

    def _sweep_locked(self, now: float) -> list[_Entry]:
        finished: list[_Entry] = []
        for entry in list(self._entries):
            task = entry.task
            entry.rule.update(task, self._dead, now)
            status = entry.rule.exit_status(task, self._dead, now)
            if status is None and task.timeout > 0 and now - task.schedule_time >= task.timeout:
                status = TaskCompletionStatus.TIMEOUT
            if status is not None:
                finished += self._complete_locked(entry, status)
        return finished

    def _complete_locked(self, entry: _Entry, status: TaskCompletionStatus) -> list[_Entry]:
        """Take the task out of the queue; return it when it can finish now (no result in flight)."""
        if entry.completed:
            return []
        entry.completed = True
        task = entry.task
        task.completion_status = status
        # A client still working when the task ends did not answer in the time the task allowed
        # (timeout, or enough results and the wait after them); only a cancel is a cancel.
        cancelled = status in (TaskCompletionStatus.CANCELLED, TaskCompletionStatus.ABORTED)
        leftover = TaskCompletionStatus.CANCELLED if cancelled else TaskCompletionStatus.TIMEOUT
        for client_task in task.client_tasks:
            if client_task.status is None:
                client_task.status = leftover
                client_task.reason = f"no result before the task ended {status.value}"
            self._open.pop(client_task.id, None)
        self._entries.remove(entry)
        del self._by_task[task]
        if entry.results_in_flight:
            return []
        entry.finishing = True
        return [entry]

    # -- outside the lock -------------------------------------------------------------------------

    def _deliver(self, entry: _Entry, client_task: ClientTask) -> TaskAssignment | None:
        task, client = entry.task, client_task.client
        with entry.send_lock:
            if not run_callback(task.before_task_sent_cb, client_task, "before_task_sent_cb", task, client):
                self.fail_client_task(client, client_task.id, "before_task_sent_cb raised")
                return None
            if client_task.status is not None:  # the task ended meanwhile
                return None
            data = shallow_copy(task.data)
            data.set_header(ReservedHeaderKey.TASK_NAME, task.name)
            data.set_header(ReservedHeaderKey.TASK_ID, client_task.id)
            run_callback(task.after_task_sent_cb, client_task, "after_task_sent_cb", task, client)
        logger.debug("task sent: task=%s client=%s task_id=%s", task.name, client, client_task.id)
        return TaskAssignment(task.name, client_task.id, data, client_task)

    def _finish(self, entries: Iterable[_Entry]) -> None:
        for entry in entries:
            task = entry.task
            logger.info("task done: task=%s status=%s", task.name, task.completion_status.value)
            run_callback(task.task_done_cb, task, "task_done_cb", task, "-")
            task._mark_done()

    def _report_late(self, client: str, task_id: str, result: Shareable) -> None:
        task_name = result.get_header(ReservedHeaderKey.TASK_NAME, "")
        handler = self._late_result_handler
        if handler is None:
            logger.warning("late result ignored: client=%s task_name=%s task_id=%s", client, task_name, task_id)
            return
        try:
            handler(client, task_name, task_id, result)
        except Exception:
            logger.exception(
                "late result handler raised: client=%s task_name=%s task_id=%s", client, task_name, task_id
            )


def _run_result_callback(task: Task, client_task: ClientTask) -> str | None:
    """Run ``result_received_cb``; return why the result was refused, or None when it was used."""
    if task.result_received_cb is None:
        return None
    try:
        task.result_received_cb(client_task)
    except ResultRefused as e:
        logger.warning("result refused: task=%s client=%s reason=%s", task.name, client_task.client, e)
        return str(e)
    except Exception:
        logger.exception("result_received_cb raised: task=%s client=%s", task.name, client_task.client)
        return "result_received_cb raised"
    return None
