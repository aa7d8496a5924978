"""send and send_and_wait: one target does the task, in order or whoever asks first."""

from __future__ import annotations

import pytest

from engine.controller import SendOrder, Task, TaskCompletionStatus, TaskQueue
from engine.model import Shareable

from .conftest import CLIENTS, FakeClock, Workflow, answer

OK = TaskCompletionStatus.OK
ORDER = ["site-2", "site-1", "site-3"]


def _takers(queue: TaskQueue, clients: list[str]) -> list[str]:
    """The clients (asking in this order) that got a task."""
    return [client for client in clients if queue.next_task(client) is not None]


def test_sequential_only_the_first_target_gets_it(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("submit_model", Shareable())
    controller.send(task, targets=ORDER)

    others = _takers(queue, ["site-1", "site-3"])
    first = queue.next_task("site-2")
    answer(queue, first)

    assert others == []
    assert first is not None
    assert task.completion_status is OK
    assert _takers(queue, CLIENTS) == []


@pytest.mark.parametrize(
    ("elapsed_s", "eligible"),
    [
        (0.0, ["site-2"]),
        (4.9, ["site-2"]),
        (5.0, ["site-2", "site-1"]),
        (10.0, ORDER),
        (100.0, ORDER),
    ],
    ids=["at-once", "before-timeout", "one-timeout", "two-timeouts", "long-after"],
)
def test_sequential_assignment_timeout_lets_the_next_targets_take_it(elapsed_s: float, eligible: list[str]) -> None:
    may_take = []
    for client in CLIENTS:  # each client asks alone, in a run of its own
        clock = FakeClock()
        queue = TaskQueue(CLIENTS, clock=clock)
        workflow = Workflow()
        workflow.bind(queue)
        workflow.send(Task("submit_model", Shareable()), targets=ORDER, task_assignment_timeout=5.0)
        clock.advance(elapsed_s)
        if queue.next_task(client) is not None:
            may_take.append(client)

    assert sorted(may_take) == sorted(eligible)


def test_only_one_target_holds_the_task(controller: Workflow, queue: TaskQueue, clock: FakeClock) -> None:
    controller.send(Task("submit_model", Shareable()), targets=ORDER, task_assignment_timeout=5.0)
    clock.advance(10.0)

    assert _takers(queue, ["site-3", "site-1", "site-2"]) == ["site-3"]


@pytest.mark.parametrize("task_assignment_timeout", [0.0, 5.0], ids=["no-timeout", "timeout-ignored"])
def test_any_order_goes_to_whoever_asks_first(
    controller: Workflow, queue: TaskQueue, task_assignment_timeout: float
) -> None:
    task = Task("submit_model", Shareable())
    controller.send(task, targets=ORDER, send_order=SendOrder.ANY, task_assignment_timeout=task_assignment_timeout)

    takers = _takers(queue, ["site-3", "site-1", "site-2"])

    assert takers == ["site-3"]
    assert list(task.last_client_task_map) == ["site-3"]


@pytest.mark.parametrize("how", ["dead", "failed"])
def test_a_lost_assignment_goes_to_the_next_target(controller: Workflow, queue: TaskQueue, how: str) -> None:
    task = Task("submit_model", Shareable())
    controller.send(task, targets=ORDER)
    first = queue.next_task("site-2")

    if how == "dead":
        queue.client_dead("site-2")
    else:
        queue.fail_client_task("site-2", first.task_id, "task data filter failed")
    second = queue.next_task("site-1")
    answer(queue, second)

    assert first.client_task.status is (
        TaskCompletionStatus.CLIENT_DEAD if how == "dead" else TaskCompletionStatus.ERROR
    )
    assert task.completion_status is OK
    assert [ct.client for ct in task.client_tasks] == ["site-2", "site-1"]


def test_send_ends_client_dead_when_every_target_is_dead(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("submit_model", Shareable())
    controller.send(task, targets=["site-1", "site-2"])
    queue.next_task("site-1")

    queue.client_dead("site-1")
    queue.client_dead("site-2")

    assert task.completion_status is TaskCompletionStatus.CLIENT_DEAD


def test_send_and_wait_returns_with_the_one_result(controller: Workflow, simulated_clients) -> None:
    task = Task("submit_model", Shareable())

    with simulated_clients() as clients:
        controller.send_and_wait(task, targets=["site-3"])

    assert task.completion_status is OK
    assert [ct.client for ct in task.client_tasks] == ["site-3"]
    assert task.client_tasks[0].result is not None
    assert [name for name, _ in clients.outcomes] == ["site-3"]
