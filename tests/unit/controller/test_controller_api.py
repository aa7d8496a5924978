"""The Controller base: argument checks, binding, cancelling, aborting, late results."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from engine.controller import Controller, JobContext, SubmitOutcome, Task, TaskCompletionStatus, TaskQueue
from engine.model import Shareable

from .conftest import CLIENTS, Workflow, answer, make_result


def _task() -> Task:
    return Task("train", Shareable())


@pytest.mark.parametrize(
    ("schedule", "error", "match"),
    [
        (lambda c: c.broadcast(_task(), targets=["site-1", "site-9"]), ValueError, r"unknown client\(s\) \['site-9'\]"),
        (lambda c: c.send(_task(), targets=["nobody"]), ValueError, r"unknown client\(s\) \['nobody'\]"),
        (lambda c: c.relay(_task(), targets=["site-1", "site-1"]), ValueError, r"\['site-1'\] named more than once"),
        (lambda c: c.broadcast(_task(), targets=[]), ValueError, "targets is empty; pass None for every client"),
        (lambda c: c.broadcast(_task(), targets="site-1"), TypeError, "targets must be a list of client names"),
        (lambda c: c.broadcast(_task(), min_responses=4), ValueError, r"min_responses=4 must be 0\.\.3"),
        (
            lambda c: c.broadcast(_task(), targets=["site-1"], min_responses=2),
            ValueError,
            r"min_responses=2 must be 0\.\.1",
        ),
        (
            lambda c: c.broadcast(_task(), wait_time_after_min_received=-1),
            ValueError,
            "wait_time_after_min_received must be >= 0",
        ),
        (lambda c: c.send(_task(), task_assignment_timeout=-1), ValueError, "task_assignment_timeout must be >= 0"),
        (lambda c: c.relay(_task(), task_result_timeout=-1), ValueError, "task_result_timeout must be >= 0"),
    ],
    ids=[
        "unknown-target",
        "unknown-send-target",
        "repeated-target",
        "empty-targets",
        "string-targets",
        "min-responses-over-clients",
        "min-responses-over-targets",
        "negative-wait",
        "negative-assignment-timeout",
        "negative-result-timeout",
    ],
)
def test_bad_arguments_are_refused_before_scheduling(
    controller: Workflow, queue: TaskQueue, schedule: Callable[[Workflow], None], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        schedule(controller)

    assert queue.pending_tasks() == []


@pytest.mark.parametrize(
    "again",
    [lambda c, t: c.broadcast(t), lambda c, t: c.send(t), lambda c, t: c.relay(t)],
    ids=["broadcast", "send", "relay"],
)
def test_a_task_is_scheduled_once(controller: Workflow, queue: TaskQueue, again) -> None:
    task = _task()
    controller.broadcast(task, targets=["site-1"])
    answer(queue, queue.next_task("site-1"))

    with pytest.raises(ValueError, match="task 'train' was already scheduled; create a new Task for each use"):
        again(controller, task)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": ""}, ValueError, "task name must be a non-empty string"),
        ({"data": {"w": 1}}, TypeError, "task 'train': data must be a Shareable, got dict"),
        ({"timeout": -1.0}, ValueError, r"task 'train': timeout must be >= 0 seconds"),
    ],
    ids=["empty-name", "plain-dict", "negative-timeout"],
)
def test_bad_task_arguments(kwargs: dict, error: type, match: str) -> None:
    arguments = {"name": "train", "data": Shareable(), **kwargs}

    with pytest.raises(error, match=match):
        Task(**arguments)


def test_an_unbound_controller_says_what_is_missing() -> None:
    with pytest.raises(
        RuntimeError, match=r"Workflow is not bound to a task queue: the runtime calls bind\(\) before run\(\)"
    ):
        Workflow().broadcast(_task())


def test_bind_gives_clients_abort_signal_and_context(queue: TaskQueue) -> None:
    workflow, signal, context = Workflow(), threading.Event(), JobContext(job_id="job-7")

    workflow.bind(queue, signal, context)

    assert workflow.get_clients() == CLIENTS
    assert workflow.abort_signal is signal and workflow.context is context


def test_controller_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        Controller()


@pytest.mark.parametrize(
    "status", [TaskCompletionStatus.CANCELLED, TaskCompletionStatus.ABORTED], ids=["default", "explicit"]
)
def test_cancel_task(controller: Workflow, queue: TaskQueue, status: TaskCompletionStatus) -> None:
    task, other = _task(), Task("other", Shareable())
    controller.broadcast(task)
    controller.broadcast(other)
    assignment = queue.next_task("site-1")

    if status is TaskCompletionStatus.CANCELLED:
        controller.cancel_task(task)
    else:
        controller.cancel_task(task, completion_status=status)

    assert task.is_done and task.completion_status is status
    assert assignment.client_task.status is TaskCompletionStatus.CANCELLED
    assert answer(queue, assignment) is SubmitOutcome.LATE
    assert queue.next_task("site-2").task_name == "other"
    assert queue.pending_tasks() == [other]


def test_cancel_all_tasks(controller: Workflow, queue: TaskQueue) -> None:
    tasks = [Task(f"task-{i}", Shareable()) for i in range(3)]
    for task in tasks:
        controller.broadcast(task)

    controller.cancel_all_tasks(TaskCompletionStatus.ABORTED)

    assert [t.completion_status for t in tasks] == [TaskCompletionStatus.ABORTED] * 3
    assert queue.pending_tasks() == [] and queue.next_task("site-1") is None


@pytest.mark.parametrize("whose", ["argument", "controller"])
def test_abort_signal_stops_a_wait(controller: Workflow, simulated_clients, whose: str) -> None:
    task = _task()
    signal = threading.Event() if whose == "argument" else controller.abort_signal

    def answer_then_abort(client: str, assignment) -> Shareable:
        signal.set()  # the job is aborted while the workflow waits for the other clients
        return make_result(task_name=assignment.task_name)

    started = time.monotonic()
    with simulated_clients(names=["site-1"], reply=answer_then_abort):
        if whose == "argument":
            controller.broadcast_and_wait(task, min_responses=0, abort_signal=signal)
        else:
            controller.broadcast_and_wait(task, min_responses=0)

    assert time.monotonic() - started < 1.0
    assert task.completion_status is TaskCompletionStatus.ABORTED
    assert [ct.client for ct in task.client_tasks] == ["site-1"]


def test_the_default_late_result_handler_logs_a_warning(queue: TaskQueue, caplog: pytest.LogCaptureFixture) -> None:
    class Plain(Controller):
        def run(self) -> None:
            pass

    Plain().bind(queue)

    with caplog.at_level(logging.WARNING, logger="engine.controller"):
        outcome = queue.submit("site-1", "gone", make_result(task_name="train"))

    assert outcome is SubmitOutcome.LATE
    assert "late result from client=site-1 task_name=train task_id=gone ignored" in caplog.text
