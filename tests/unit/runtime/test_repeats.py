"""A client's task request or result asked again gets the first answer (real cells on 127.0.0.1)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.cells import Cell, CellSettings, Message, Reply
from engine.controller import SubmitOutcome
from engine.runtime import protocol
from engine.runtime.repeats import RepeatedRequests

SETTINGS = CellSettings(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)


class Server:
    """A server cell whose task handlers count their calls, wrapped by `RepeatedRequests`."""

    def __init__(self) -> None:
        self.expected = SubmitOutcome.ACCEPTED
        self.gets = 0
        self.submits = 0
        self.submit_gate = threading.Event()
        self.cell = Cell("server", SETTINGS).start()
        self.site = Cell("site-1", SETTINGS, connect_to=self.cell.endpoint).start()
        assert self.site.wait_connected(10)
        self.repeats = repeats = RepeatedRequests(lambda site, task_id: self.expected, submit_wait_s=5.0)
        self.cell.register_handler(protocol.TASK_CHANNEL, protocol.TOPIC_GET_TASK, repeats.get_task(self._get))
        self.cell.register_handler(protocol.TASK_CHANNEL, protocol.TOPIC_SUBMIT, repeats.submit(self._submit))

    def _get(self, message: Message) -> Reply:
        self.gets += 1
        return Reply(header={"state": protocol.STATE_TASK, "task_id": f"t{self.gets}", "task_name": "train"})

    def _submit(self, message: Message) -> Reply:
        self.submits += 1
        self.submit_gate.wait(5)
        return Reply(header={"outcome": "ACCEPTED", "held": True})

    def ask(self, topic: str, **header: str) -> Message:
        return self.site.request("server", protocol.TASK_CHANNEL, topic, header, timeout_s=10)

    def close(self) -> None:
        self.submit_gate.set()
        self.site.stop(timeout_s=3)
        self.cell.stop(timeout_s=3)


@pytest.fixture
def server() -> Iterator[Server]:
    opened = Server()
    yield opened
    opened.close()


def test_a_repeated_task_request_gets_the_same_task_not_a_second_one(server: Server) -> None:
    first = server.ask(protocol.TOPIC_GET_TASK, request_id="r1")
    again = server.ask(protocol.TOPIC_GET_TASK, request_id="r1")
    next_one = server.ask(protocol.TOPIC_GET_TASK, request_id="r2")

    assert first.header["task_id"] == again.header["task_id"] == "t1"
    assert next_one.header["task_id"] == "t2"
    assert server.gets == 2


def test_a_task_no_longer_expected_is_not_sent_again(server: Server) -> None:
    server.ask(protocol.TOPIC_GET_TASK, request_id="r1")
    server.expected = SubmitOutcome.LATE  # the task ended meanwhile (the site was dead, say)

    again = server.ask(protocol.TOPIC_GET_TASK, request_id="r1")

    assert again.header["task_id"] == "t2"


def test_a_result_sent_again_while_the_first_is_received_waits_and_gets_its_answer(server: Server) -> None:
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(server.ask, protocol.TOPIC_SUBMIT, task_id="t1", request_id="s1")
        again = pool.submit(server.ask, protocol.TOPIC_SUBMIT, task_id="t1", request_id="s1")
        server.submit_gate.set()
        answers = [first.result(10).header, again.result(10).header]
    after = server.ask(protocol.TOPIC_SUBMIT, task_id="t1", request_id="s1")

    assert answers == [{"outcome": "ACCEPTED", "held": True}] * 2
    assert after.header == {"outcome": "ACCEPTED", "held": True}
    assert server.submits == 1  # pulled once


def test_requests_without_a_request_id_go_to_the_handler_every_time(server: Server) -> None:
    server.submit_gate.set()
    server.ask(protocol.TOPIC_SUBMIT, task_id="t1")
    server.ask(protocol.TOPIC_SUBMIT, task_id="t1")
    server.ask(protocol.TOPIC_GET_TASK)
    server.ask(protocol.TOPIC_GET_TASK)

    assert (server.submits, server.gets) == (2, 2)


def test_a_dead_site_s_answers_are_forgotten_but_a_result_still_received_keeps_its_own(server: Server) -> None:
    """A task reply may hold the model (inline tensors): a dead site's is not kept for the job's life."""
    server.ask(protocol.TOPIC_GET_TASK, request_id="r1")
    with ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(server.ask, protocol.TOPIC_SUBMIT, task_id="t1", request_id="s1")
        while server.submits == 0:
            threading.Event().wait(0.01)
        server.repeats.forget("site-1")
        again = server.ask(protocol.TOPIC_GET_TASK, request_id="r1")
        server.submit_gate.set()
        first = receiving.result(10)
    repeated = server.ask(protocol.TOPIC_SUBMIT, task_id="t1", request_id="s1")

    assert again.header["task_id"] == "t2"  # asked anew: the first reply was not kept
    assert repeated.header == first.header and server.submits == 1  # the result's answer was
