"""`TaskQueue.clients_with_work`: which of a worker's virtual clients would get a task now, nothing assigned."""

from __future__ import annotations

from engine.controller import Task, TaskQueue
from engine.model import Shareable

from .conftest import Workflow, answer


def test_only_the_targets_still_owed_the_task_have_work(controller: Workflow, queue: TaskQueue) -> None:
    controller.broadcast(Task("train", Shareable()), targets=["site-1", "site-3"], min_responses=2)

    assert queue.clients_with_work(["site-1", "site-2", "site-3"]) == ["site-1", "site-3"]
    assert queue.clients_with_work(["site-2"]) == []
    assert queue.clients_with_work(["site-3", "site-1"]) == ["site-1", "site-3"]  # asking assigns nothing

    answer(queue, queue.next_task("site-1"))

    assert queue.clients_with_work(["site-1", "site-3"]) == ["site-3"]  # site-1 had its task


def test_dead_clients_and_an_ended_run_have_no_work(controller: Workflow, queue: TaskQueue) -> None:
    controller.broadcast(Task("train", Shareable()), min_responses=3)
    queue.client_dead("site-2")

    assert queue.clients_with_work(["site-1", "site-2"]) == ["site-1"]

    queue.end_run()

    assert queue.clients_with_work(["site-1", "site-2", "site-3"]) == []


def test_a_send_task_is_work_for_the_one_client_it_goes_to_next(controller: Workflow, queue: TaskQueue) -> None:
    controller.send(Task("submit_model", Shareable()), targets=["site-2", "site-3"])

    assert queue.clients_with_work(["site-1", "site-2", "site-3"]) == ["site-2"]  # sequential: site-2 first
