"""broadcast, broadcast_and_wait and broadcast_forever: who gets the task and when it completes."""

from __future__ import annotations

import time

import pytest

from engine.controller import Task, TaskCompletionStatus, TaskQueue
from engine.errors import ResultRefused
from engine.model import ReservedHeaderKey, ReturnCode, Shareable

from .conftest import CLIENTS, FakeClock, SimulatedClients, Workflow, answer

OK = TaskCompletionStatus.OK


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (None, CLIENTS),
        (["site-1", "site-3"], ["site-1", "site-3"]),
        (["site-2"], ["site-2"]),
    ],
    ids=["all-clients", "two-targets", "one-target"],
)
def test_every_target_gets_the_task_once(
    controller: Workflow, queue: TaskQueue, targets: list[str] | None, expected: list[str]
) -> None:
    task = Task("train", Shareable())

    controller.broadcast(task, targets=targets)
    first = {client: queue.next_task(client) for client in CLIENTS}
    second = {client: queue.next_task(client) for client in CLIENTS}

    assert sorted(c for c, a in first.items() if a is not None) == expected
    assert all(a is None for a in second.values())
    assert task.targets == expected


def test_assignment_is_a_shallow_copy_with_task_headers(controller: Workflow, queue: TaskQueue) -> None:
    weights = [1.0, 2.0]
    data = Shareable({"weights": weights})
    data.set_header(ReservedHeaderKey.CURRENT_ROUND, 3)
    task = Task("train", data)
    controller.broadcast(task)

    one = queue.next_task("site-1")
    two = queue.next_task("site-2")

    assert one.data["weights"] is weights and two.data["weights"] is weights
    assert one.data.get_header(ReservedHeaderKey.TASK_NAME) == "train"
    assert one.data.get_header(ReservedHeaderKey.TASK_ID) == one.task_id == one.client_task.id
    assert one.data.get_header(ReservedHeaderKey.CURRENT_ROUND) == 3
    assert one.task_id != two.task_id
    assert data.get_header(ReservedHeaderKey.TASK_ID) is None


@pytest.mark.parametrize(
    ("min_responses", "answering", "done"),
    [
        (1, ["site-1"], True),
        (2, ["site-1"], False),
        (2, ["site-1", "site-3"], True),
        (0, ["site-1", "site-2"], False),
        (0, CLIENTS, True),
    ],
    ids=["1-of-1", "1-of-2", "2-of-2", "all-needed-2-answered", "all-answered"],
)
def test_min_responses(
    controller: Workflow, queue: TaskQueue, min_responses: int, answering: list[str], done: bool
) -> None:
    task = Task("train", Shareable())
    controller.broadcast(task, min_responses=min_responses)
    assignments = {client: queue.next_task(client) for client in CLIENTS}

    for client in answering:
        answer(queue, assignments[client])

    assert task.is_done is done
    assert task.completion_status is (OK if done else None)


def test_a_failed_result_is_not_a_usable_response(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("train", Shareable())
    controller.broadcast(task, targets=["site-1", "site-2"], min_responses=1)

    answer(queue, queue.next_task("site-1"), ReturnCode.EXECUTION_EXCEPTION)
    assert task.completion_status is None  # site-2 may still give the one usable result
    answer(queue, queue.next_task("site-2"), ReturnCode.EXECUTION_EXCEPTION)

    assert task.completion_status is TaskCompletionStatus.ERROR
    assert task.last_client_task_map["site-1"].status is TaskCompletionStatus.ERROR


def test_a_result_the_callback_refuses_is_not_a_usable_response(controller: Workflow, queue: TaskQueue) -> None:
    def refuse_site_1(client_task) -> None:
        if client_task.client == "site-1":
            raise ResultRefused("shape (2,) does not fit")

    task = Task("train", Shareable(), result_received_cb=refuse_site_1)
    controller.broadcast(task, targets=["site-1", "site-2"], min_responses=1)

    answer(queue, queue.next_task("site-1"), ReturnCode.OK)
    assert task.completion_status is None
    assert task.last_client_task_map["site-1"].reason == "shape (2,) does not fit"
    answer(queue, queue.next_task("site-2"), ReturnCode.OK)

    assert task.completion_status is OK


def test_wait_time_after_min_received_keeps_the_task_open(
    controller: Workflow, queue: TaskQueue, clock: FakeClock
) -> None:
    task = Task("train", Shareable())
    controller.broadcast(task, min_responses=1, wait_time_after_min_received=10.0)
    assignments = {client: queue.next_task(client) for client in CLIENTS}
    answer(queue, assignments["site-1"])

    clock.advance(9.0)
    queue.check()
    still_open = not task.is_done
    answer(queue, assignments["site-2"])
    clock.advance(1.0)
    queue.check()

    assert still_open
    assert task.completion_status is OK
    assert [ct.client for ct in task.client_tasks if ct.result is not None] == ["site-1", "site-2"]
    assert task.last_client_task_map["site-3"].status is TaskCompletionStatus.TIMEOUT
    assert task.last_client_task_map["site-3"].reason == "no result before the task ended OK"


def test_all_responded_ends_the_wait_at_once(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("train", Shareable())
    controller.broadcast(task, min_responses=1, wait_time_after_min_received=3600.0)
    assignments = [queue.next_task(client) for client in CLIENTS]

    for assignment in assignments:
        answer(queue, assignment)

    assert task.completion_status is OK


def test_broadcast_and_wait_returns_with_every_result(controller: Workflow, simulated_clients) -> None:
    received: list[str] = []
    task = Task("train", Shareable(), result_received_cb=lambda ct: received.append(ct.client))

    with simulated_clients():
        controller.broadcast_and_wait(task, min_responses=0)

    assert task.is_done and task.completion_status is OK
    assert sorted(received) == CLIENTS


def test_broadcast_and_wait_with_the_real_clock_waits_after_min_received() -> None:
    queue = TaskQueue(CLIENTS)
    workflow = Workflow()
    workflow.bind(queue)
    task = Task("train", Shareable())
    started = time.monotonic()

    with SimulatedClients(queue, ["site-1"]):
        workflow.broadcast_and_wait(task, min_responses=1, wait_time_after_min_received=0.2)

    assert 0.2 <= time.monotonic() - started < 0.9
    assert task.completion_status is OK
    assert [ct.client for ct in task.client_tasks if ct.result_received_time is not None] == ["site-1"]


def test_broadcast_forever_gives_the_task_again_and_never_completes(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("heartbeat", Shareable())
    controller.broadcast_forever(task, targets=["site-1", "site-2"])

    first = queue.next_task("site-1")
    while_open = queue.next_task("site-1")
    answer(queue, first)
    again = queue.next_task("site-1")
    answer(queue, again)
    answer(queue, queue.next_task("site-2"))
    queue.check()

    assert while_open is None
    assert again is not None and again.task_id != first.task_id
    assert queue.next_task("site-3") is None
    assert not task.is_done
    controller.cancel_task(task)
    assert task.completion_status is TaskCompletionStatus.CANCELLED
