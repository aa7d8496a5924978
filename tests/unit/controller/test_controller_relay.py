"""relay and relay_and_wait: targets take turns, each starting from the previous result."""

from __future__ import annotations

import pytest

from engine.controller import SendOrder, SubmitOutcome, Task, TaskAssignment, TaskCompletionStatus, TaskQueue
from engine.model import ReservedHeaderKey, ReturnCode, Shareable

from .conftest import CLIENTS, FakeClock, Workflow, answer, make_result

OK = TaskCompletionStatus.OK
ORDER = ["site-3", "site-1", "site-2"]


def _add_one(queue: TaskQueue, assignment: TaskAssignment) -> SubmitOutcome:
    """Answer as a client that adds 1 to the count it was given."""
    result = make_result(task_name=assignment.task_name, count=assignment.data["count"] + 1)
    return queue.submit(assignment.client_task.client, assignment.task_id, result)


def test_sequential_relay_visits_targets_in_order_passing_results_on(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("cyclic", Shareable({"count": 0}))
    controller.relay(task, targets=ORDER)
    counts_seen = []

    for client in ORDER:
        not_yet = [c for c in CLIENTS if c != client and queue.next_task(c) is not None]
        assignment = queue.next_task(client)
        counts_seen.append(assignment.data["count"])
        _add_one(queue, assignment)
        assert not_yet == []

    assert counts_seen == [0, 1, 2]
    assert task.completion_status is OK
    assert task.data["count"] == 3
    assert task.data.get_header(ReservedHeaderKey.RETURN_CODE) is None


def test_a_failed_result_is_not_passed_on(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("cyclic", Shareable({"count": 0}))
    controller.relay(task, targets=["site-1", "site-2"])

    first = queue.next_task("site-1")
    queue.submit("site-1", first.task_id, make_result(ReturnCode.EXECUTION_EXCEPTION, count=99))
    second = queue.next_task("site-2")

    assert second.data["count"] == 0
    assert first.client_task.status is TaskCompletionStatus.ERROR


def test_task_result_timeout_moves_the_turn_on(controller: Workflow, queue: TaskQueue, clock: FakeClock) -> None:
    task = Task("cyclic", Shareable({"count": 0}))
    controller.relay(task, targets=["site-1", "site-2"], task_result_timeout=30.0)
    slow = queue.next_task("site-1")

    clock.advance(29.0)
    too_early = queue.next_task("site-2")
    clock.advance(1.0)
    queue.check()
    second = queue.next_task("site-2")
    late = _add_one(queue, slow)
    _add_one(queue, second)

    assert too_early is None
    assert slow.client_task.status is TaskCompletionStatus.TIMEOUT
    assert late is SubmitOutcome.LATE and controller.late == [("site-1", "cyclic", slow.task_id)]
    assert task.completion_status is OK and task.data["count"] == 1


def test_task_assignment_timeout_skips_a_target_that_does_not_ask(
    controller: Workflow, queue: TaskQueue, clock: FakeClock
) -> None:
    task = Task("cyclic", Shareable({"count": 0}))
    controller.relay(task, targets=["site-1", "site-2"], task_assignment_timeout=5.0)

    before = queue.next_task("site-2")
    clock.advance(5.0)
    second = queue.next_task("site-2")
    _add_one(queue, second)

    assert before is None
    assert task.completion_status is OK
    assert [ct.client for ct in task.client_tasks] == ["site-2"]


def test_relay_ends_timeout_when_no_target_ever_asks(controller: Workflow, queue: TaskQueue, clock: FakeClock) -> None:
    task = Task("cyclic", Shareable())
    controller.relay(task, targets=["site-1", "site-2"], task_assignment_timeout=5.0)

    clock.advance(9.9)
    queue.check()
    open_before = not task.is_done
    clock.advance(0.1)
    queue.check()

    assert open_before
    assert task.completion_status is TaskCompletionStatus.TIMEOUT


@pytest.mark.parametrize(
    ("send_order", "dynamic_targets", "asking", "turns", "targets"),
    [
        (
            SendOrder.SEQUENTIAL,
            True,
            ["site-2", "site-3", "site-1"],
            ["site-2", "site-3", "site-1"],
            ["site-2", "site-3", "site-1"],
        ),
        (SendOrder.SEQUENTIAL, False, ["site-2", "site-3", "site-1"], CLIENTS, CLIENTS),
        (SendOrder.ANY, False, ["site-3", "site-1", "site-2"], ["site-3", "site-1", "site-2"], CLIENTS),
    ],
    ids=["dynamic-order-of-asking", "static-client-order", "any-order"],
)
def test_targets_none(
    controller: Workflow,
    queue: TaskQueue,
    send_order: SendOrder,
    dynamic_targets: bool,
    asking: list[str],
    turns: list[str],
    targets: list[str],
) -> None:
    task = Task("cyclic", Shareable({"count": 0}))
    controller.relay(task, send_order=send_order, dynamic_targets=dynamic_targets)

    taken = []
    for _ in range(len(CLIENTS)):  # every pass over the clients hands out at least one turn
        for client in asking:
            assignment = queue.next_task(client)
            if assignment is not None:
                taken.append(client)
                _add_one(queue, assignment)

    assert taken == turns
    assert task.targets == targets
    assert task.completion_status is OK and task.data["count"] == 3


def test_a_dead_target_is_skipped(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("cyclic", Shareable({"count": 0}))
    controller.relay(task, targets=ORDER)
    holder = queue.next_task("site-3")

    queue.client_dead("site-3")
    queue.client_dead("site-1")
    _add_one(queue, queue.next_task("site-2"))

    assert holder.client_task.status is TaskCompletionStatus.CLIENT_DEAD
    assert task.completion_status is OK and task.data["count"] == 1


def test_relay_and_wait_passes_the_count_around(controller: Workflow, simulated_clients) -> None:
    task = Task("cyclic", Shareable({"count": 10}))

    def add_one(client: str, assignment: TaskAssignment) -> Shareable:
        return make_result(task_name=assignment.task_name, count=assignment.data["count"] + 1)

    with simulated_clients(reply=add_one):
        controller.relay_and_wait(task, targets=ORDER)

    assert task.completion_status is OK
    assert task.data["count"] == 13
    assert [ct.client for ct in task.client_tasks] == ORDER


def test_the_result_callback_may_replace_the_data_for_the_next_target(controller: Workflow, queue: TaskQueue) -> None:
    def reset(client_task) -> None:
        client_task.task.data = Shareable({"count": 100})

    task = Task("cyclic", Shareable({"count": 0}), result_received_cb=reset)
    controller.relay(task, targets=["site-1", "site-2"])

    answer(queue, queue.next_task("site-1"))

    assert queue.next_task("site-2").data["count"] == 100
