"""The task lifecycle in the queue: order, results, dead clients, timeouts, callbacks, end of run."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from engine.controller import SubmitOutcome, Task, TaskCompletionStatus, TaskQueue
from engine.model import Shareable

from .conftest import CLIENTS, FakeClock, Workflow, answer, make_result

OK = TaskCompletionStatus.OK


def test_a_client_gets_the_first_task_in_queue_order_it_may_take(controller: Workflow, queue: TaskQueue) -> None:
    only_two = Task("only_two", Shareable())
    for_all = Task("for_all", Shareable())
    controller.broadcast(only_two, targets=["site-2"])
    controller.broadcast(for_all)

    site_1 = [queue.next_task("site-1"), queue.next_task("site-1")]
    site_2 = [queue.next_task("site-2"), queue.next_task("site-2"), queue.next_task("site-2")]

    assert [a and a.task_name for a in site_1] == ["for_all", None]
    assert [a and a.task_name for a in site_2] == ["only_two", "for_all", None]


def test_no_task_means_try_again_later(controller: Workflow, queue: TaskQueue) -> None:
    empty = [queue.next_task(client) for client in CLIENTS]
    task = Task("train", Shareable())
    controller.broadcast(task, targets=["site-1"])
    answer(queue, queue.next_task("site-1"))

    assert empty == [None, None, None]
    assert queue.next_task("site-1") is None
    assert queue.next_task("not-a-client") is None
    assert queue.pending_tasks() == []


def test_the_schedule_listener_hears_the_targets_of_each_new_task(controller: Workflow, queue: TaskQueue) -> None:
    heard: list[list[str]] = []
    queue.set_schedule_listener(heard.append)

    controller.broadcast(Task("only_two", Shareable()), targets=["site-2"])
    controller.broadcast(Task("for_all", Shareable()))
    queue.set_schedule_listener(None)
    controller.broadcast(Task("unheard", Shareable()))

    assert heard == [["site-2"], list(CLIENTS)]


def test_a_raising_schedule_listener_does_not_stop_the_task(controller: Workflow, queue: TaskQueue) -> None:
    def broken(targets: list[str]) -> None:
        raise RuntimeError("no cell")

    queue.set_schedule_listener(broken)
    controller.broadcast(Task("train", Shareable()), targets=["site-1"])

    assignment = queue.next_task("site-1")
    assert assignment is not None and assignment.task_name == "train"


@pytest.mark.parametrize("case", ["unknown-id", "task-done", "other-client"])
def test_a_late_result_goes_to_process_result_of_unknown_task(
    controller: Workflow, queue: TaskQueue, case: str
) -> None:
    received = []
    task = Task("train", Shareable(), result_received_cb=lambda ct: received.append(ct.client))
    controller.broadcast(task, min_responses=1)
    one, two = queue.next_task("site-1"), queue.next_task("site-2")
    answer(queue, one)
    received.clear()
    client, task_id = {
        "unknown-id": ("site-3", "no-such-id"),
        "task-done": ("site-2", two.task_id),
        "other-client": ("site-3", two.task_id),
    }[case]

    outcome = queue.submit(client, task_id, make_result(task_name="train"))

    assert outcome is SubmitOutcome.LATE
    assert controller.late == [(client, "train", task_id)]
    assert received == []


def test_a_duplicate_result_is_counted_once(controller: Workflow, queue: TaskQueue) -> None:
    calls = Counter()
    task = Task("train", Shareable(), result_received_cb=lambda ct: calls.update([ct.client]))
    controller.broadcast(task, min_responses=0)
    assignment = queue.next_task("site-1")

    outcomes = [answer(queue, assignment), answer(queue, assignment)]

    assert outcomes == [SubmitOutcome.ACCEPTED, SubmitOutcome.DUPLICATE]
    assert calls == {"site-1": 1}
    assert controller.late == []


def test_a_dead_client_gets_nothing_and_its_client_task_ends_client_dead(
    controller: Workflow, queue: TaskQueue
) -> None:
    task = Task("train", Shareable())
    controller.broadcast(task, min_responses=0)
    assignments = {client: queue.next_task(client) for client in ["site-1", "site-2"]}

    queue.client_dead("site-1")
    dead_asks = queue.next_task("site-1")
    late = answer(queue, assignments["site-1"])
    answer(queue, assignments["site-2"])
    open_while_site_3_can_answer = not task.is_done
    answer(queue, queue.next_task("site-3"))

    assert dead_asks is None and late is SubmitOutcome.LATE
    assert assignments["site-1"].client_task.status is TaskCompletionStatus.CLIENT_DEAD
    assert open_while_site_3_can_answer
    assert task.completion_status is TaskCompletionStatus.CLIENT_DEAD


@pytest.mark.parametrize(
    ("min_responses", "dead", "status"),
    [
        (2, ["site-1", "site-2"], TaskCompletionStatus.CLIENT_DEAD),
        (0, CLIENTS, TaskCompletionStatus.CLIENT_DEAD),
        (1, ["site-1", "site-2"], None),
    ],
    ids=["too-few-left", "all-dead", "one-left-is-enough"],
)
def test_dead_clients_end_a_broadcast_that_cannot_get_enough_results(
    controller: Workflow, queue: TaskQueue, min_responses: int, dead: list[str], status: TaskCompletionStatus | None
) -> None:
    task = Task("train", Shareable())
    controller.broadcast(task, min_responses=min_responses)
    survivor = queue.next_task("site-3")

    for client in dead:
        queue.client_dead(client)
    if survivor is not None and "site-3" not in dead:
        answer(queue, survivor)

    assert task.completion_status is (status or OK)


def test_fail_client_task_keeps_the_reason_and_ends_the_task(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("train", Shareable())
    controller.broadcast(task, targets=["site-2"])
    assignment = queue.next_task("site-2")

    failed = queue.fail_client_task("site-2", assignment.task_id, "task data filter failed: bad key")
    again = queue.fail_client_task("site-2", assignment.task_id, "twice")

    assert (failed, again) == (True, False)
    assert assignment.client_task.status is TaskCompletionStatus.ERROR
    assert assignment.client_task.reason == "task data filter failed: bad key"
    assert task.completion_status is TaskCompletionStatus.ERROR


def test_task_timeout(controller: Workflow, queue: TaskQueue, clock: FakeClock) -> None:
    task = Task("train", Shareable(), timeout=60.0)
    controller.broadcast(task, min_responses=0)
    assignment = queue.next_task("site-1")

    clock.advance(59.0)
    queue.check()
    open_before = not task.is_done
    clock.advance(1.0)
    queue.check()

    assert open_before
    assert task.completion_status is TaskCompletionStatus.TIMEOUT
    assert assignment.client_task.status is TaskCompletionStatus.TIMEOUT
    assert answer(queue, assignment) is SubmitOutcome.LATE


def test_each_callback_runs_the_right_number_of_times(controller: Workflow, queue: TaskQueue) -> None:
    calls = Counter()
    task = Task(
        "train",
        Shareable(),
        before_task_sent_cb=lambda ct: calls.update([("before", ct.client)]),
        after_task_sent_cb=lambda ct: calls.update([("after", ct.client)]),
        result_received_cb=lambda ct: calls.update([("result", ct.client)]),
        task_done_cb=lambda t: calls.update([("done", t.name)]),
    )
    controller.broadcast(task, targets=["site-1", "site-2"], min_responses=0)

    for client in ["site-1", "site-2"]:
        assignment = queue.next_task(client)
        answer(queue, assignment)
        answer(queue, assignment)
    queue.check()
    controller.cancel_task(task)

    expected = {(kind, client): 1 for kind in ("before", "after", "result") for client in ("site-1", "site-2")}
    assert calls == {**expected, ("done", "train"): 1}


@pytest.mark.parametrize(
    ("which", "got", "site_1_status", "task_status"),
    [
        ("before_task_sent_cb", [None, "next"], TaskCompletionStatus.ERROR, TaskCompletionStatus.ERROR),
        ("after_task_sent_cb", ["train", "next"], OK, OK),
        # a result the callback could not use is no usable response: site-2's fails too
        ("result_received_cb", ["train", "next"], TaskCompletionStatus.ERROR, TaskCompletionStatus.ERROR),
        ("task_done_cb", ["train", "next"], OK, OK),
    ],
    ids=["before_task_sent_cb", "after_task_sent_cb", "result_received_cb", "task_done_cb"],
)
def test_a_raising_callback_does_not_break_the_queue(
    controller: Workflow,
    queue: TaskQueue,
    caplog: pytest.LogCaptureFixture,
    which: str,
    got: list[str | None],
    site_1_status: TaskCompletionStatus,
    task_status: TaskCompletionStatus,
) -> None:
    def boom(arg: object) -> None:
        raise RuntimeError("callback bug")

    task = Task("train", Shareable(), **{which: boom})
    controller.broadcast(task, targets=["site-1", "site-2"], min_responses=1)
    controller.broadcast(Task("next", Shareable()), targets=["site-1"])

    names = []
    for _ in range(2):
        assignment = queue.next_task("site-1")
        names.append(assignment and assignment.task_name)
        if names[-1] == "train":
            answer(queue, assignment)
    if not task.is_done:  # site-2 is the last hope of the task
        last_hope = queue.next_task("site-2")
        if last_hope is not None and which == "result_received_cb":
            answer(queue, last_hope)

    assert names == got
    assert task.is_done and task.completion_status is task_status
    assert task.last_client_task_map["site-1"].status is site_1_status
    assert f"{which} raised: task=train client=" in caplog.text


def test_task_done_cb_waits_for_a_result_callback_in_flight(
    controller: Workflow, queue: TaskQueue, run_in_thread
) -> None:
    entered, release = threading.Event(), threading.Event()
    done_calls = []

    def slow_aggregation(client_task) -> None:
        entered.set()
        release.wait(timeout=2.0)

    task = Task("train", Shareable(), result_received_cb=slow_aggregation, task_done_cb=done_calls.append)
    controller.broadcast(task, min_responses=1)
    assignment = queue.next_task("site-1")
    run_in_thread(lambda: answer(queue, assignment))
    assert entered.wait(timeout=2.0)

    controller.cancel_task(task)
    during = (task.completion_status, task.is_done, list(done_calls))
    release.set()
    finished = task.wait(timeout_s=2.0)

    assert during == (TaskCompletionStatus.CANCELLED, False, [])
    assert finished and done_calls == [task]


def test_end_run_aborts_outstanding_tasks_and_ends_every_client(controller: Workflow, queue: TaskQueue) -> None:
    task = Task("train", Shareable())
    controller.broadcast(task)
    assignment = queue.next_task("site-1")

    queue.end_run()

    assert queue.ended
    assert task.completion_status is TaskCompletionStatus.ABORTED
    assert assignment.client_task.status is TaskCompletionStatus.CANCELLED
    assert [queue.next_task(client) for client in CLIENTS] == [None, None, None]
    with pytest.raises(RuntimeError, match="cannot schedule task 'later': the run has ended"):
        controller.broadcast(Task("later", Shareable()))


def test_many_clients_at_once_each_result_counted_once(run_in_thread) -> None:
    names = [f"site-{i}" for i in range(1, 21)]
    queue = TaskQueue(names)
    workflow = Workflow()
    workflow.bind(queue)
    results, done_calls = Counter(), []
    task = Task(
        "train", Shareable(), result_received_cb=lambda ct: results.update([ct.client]), task_done_cb=done_calls.append
    )
    start = threading.Barrier(len(names) + 1, timeout=2.0)

    def client(name: str) -> None:
        start.wait()
        while (assignment := queue.next_task(name)) is None and not task.is_done:
            task.wait(timeout_s=0.001)  # "try again later": the task may not be scheduled yet
        if assignment is not None:
            answer(queue, assignment)
            answer(queue, assignment)

    for name in names:
        run_in_thread(lambda name=name: client(name))
    start.wait()
    workflow.broadcast_and_wait(task, min_responses=0)

    assert task.completion_status is OK
    assert results == {name: 1 for name in names}
    assert done_calls == [task]


@pytest.mark.parametrize(
    ("min_responses", "without", "expected"),
    [
        (2, {"site-3"}, True),
        (2, {"site-2", "site-3"}, False),
        (0, {"site-3"}, False),
        (1, {"site-1", "site-2"}, True),
    ],
    ids=["two-of-three-left", "one-left-two-needed", "every-target-needed", "one-left-is-enough"],
)
def test_a_broadcast_says_whether_it_can_do_without_some_targets(
    controller: Workflow, queue: TaskQueue, min_responses: int, without: set[str], expected: bool
) -> None:
    controller.broadcast(Task("train", Shareable()), min_responses=min_responses)
    assignment = queue.next_task("site-1")

    assert queue.can_do_without(assignment.task_id, without) is expected
    assert queue.can_do_without("no-such-task", set()) is False
