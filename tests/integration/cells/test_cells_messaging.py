"""Request/reply, fire-and-forget, routing and concurrency between real processes over TCP.

One server cell runs in the test process; ``site-1`` and ``site-2`` run in child processes
(peer_main.py) and connect to it over 127.0.0.1.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from engine.cells import Cell, CellSettings, Message, Reply, Status
from engine.errors import CellRemoteError, CellUnreachableError

from .harness import Harness


@dataclass
class Network:
    """The cells shared by this module's tests."""

    server: Cell
    notified: collections.deque[Message]
    notified_event: threading.Event


@pytest.fixture(scope="module")
def network(fast_settings: CellSettings) -> Iterator[Network]:
    harness = Harness(fast_settings)
    try:
        server = harness.cell("server")
        notified: collections.deque[Message] = collections.deque()
        event = threading.Event()

        def on_notified(message: Message) -> None:
            notified.append(message)
            event.set()

        server.register_handler("test", "notified", on_notified)
        server.register_handler("test", "whoami", lambda m: Reply(header={"you": m.source}))
        harness.peer("site-1", connect=server.endpoint)
        harness.peer("site-2", connect=server.endpoint)
        yield Network(server, notified, event)
    finally:
        harness.close()


def test_server_requests_client_process(network: Network) -> None:
    body = os.urandom(16 << 20)

    reply = network.server.request("site-1", "test", "echo", header={"round": 3}, frames=[b"meta", body], timeout_s=20)

    assert reply.status is Status.OK
    assert reply.source == "site-1"
    assert dict(reply.header) == {"round": 3}
    assert [bytes(f) for f in reply.frames] == [b"meta", body]


def test_client_process_requests_server(network: Network) -> None:
    reply = network.server.request(
        "site-1", "test", "call", header={"target": "server", "topic": "whoami"}, timeout_s=20
    )

    assert dict(reply.header) == {"you": "site-1"}


def test_fire_and_forget_round_trip(network: Network) -> None:
    network.notified.clear()
    network.notified_event.clear()

    network.server.send("site-2", "test", "notify", header={"n": 7}, frames=[b"ping"])

    assert network.notified_event.wait(10), "site-2 never sent its notification back"
    message = network.notified.popleft()
    assert (message.source, dict(message.header), bytes(message.frames[0])) == ("site-2", {"n": 7}, b"ping")


def test_client_to_client_routes_through_server(network: Network) -> None:
    payload = os.urandom(3 << 20)

    reply = network.server.request(
        "site-1",
        "test",
        "call",
        header={"target": "site-2", "topic": "echo", "inner": {"hop": "c2c"}},
        frames=[payload],
        timeout_s=20,
    )

    assert dict(reply.header) == {"hop": "c2c"}
    assert bytes(reply.frames[0]) == payload


def test_in_process_client_reaches_client_process(network: Network, harness: Harness) -> None:
    site9 = harness.cell("site-9", connect_to=network.server.endpoint)

    reply = site9.request("site-2", "test", "echo", frames=[b"x" * 100], timeout_s=20)

    assert reply.source == "site-2"
    assert bytes(reply.frames[0]) == b"x" * 100


def test_child_cell_name_is_routable(network: Network, harness: Harness) -> None:
    job_cell = harness.cell("site-9.job1", connect_to=network.server.endpoint)
    job_cell.register_handler("test", "echo", lambda m: Reply(frames=m.frames))

    reply = network.server.request(
        "site-1", "test", "call", header={"target": "site-9.job1", "topic": "echo"}, frames=[b"to-a-job"], timeout_s=20
    )

    assert bytes(reply.frames[0]) == b"to-a-job"


def test_many_concurrent_requests_from_several_threads(network: Network) -> None:
    threads, per_thread = 8, 30
    failures: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for i in range(per_thread):
                body = hashlib.sha256(f"{index}-{i}".encode()).digest() * (1 + i * 97)
                target = "site-1" if (index + i) % 2 else "site-2"
                reply = network.server.request(target, "test", "echo", header={"i": i}, frames=[body], timeout_s=20)
                assert reply.source == target and reply.header["i"] == i
                assert bytes(reply.frames[0]) == body
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)

    assert not any(t.is_alive() for t in pool), "a request thread hung"
    assert not failures, failures[0]


def test_many_requests_in_flight_from_one_thread(network: Network) -> None:
    futures = [
        network.server.request_async("site-1", "test", "echo", header={"i": i}, timeout_s=20) for i in range(200)
    ]

    replies = [f.result(30).raise_for_status() for f in futures]

    assert [r.header["i"] for r in replies] == list(range(200))


def test_handler_that_raises_gets_error_reply_and_cell_survives(network: Network) -> None:
    with pytest.raises(CellRemoteError, match=r"'site-1'.*'raise'.*ValueError: boom"):
        network.server.request("site-1", "test", "raise", timeout_s=20)

    reply = network.server.request("site-1", "test", "echo", frames=[b"still here"], timeout_s=20)
    assert bytes(reply.frames[0]) == b"still here"


@pytest.mark.parametrize(
    ("channel", "topic"), [("test", "nope"), ("nope", "echo")], ids=["unknown-topic", "unknown-channel"]
)
def test_unknown_channel_or_topic_is_answered_with_error(network: Network, channel: str, topic: str) -> None:
    with pytest.raises(CellRemoteError, match="no handler for channel"):
        network.server.request("site-2", channel, topic, timeout_s=20)


def test_request_to_unknown_cell_is_unreachable_at_once(network: Network) -> None:
    with pytest.raises(CellUnreachableError, match="'site-404'.*no cell named"):
        network.server.request("site-404", "test", "echo", timeout_s=20)


def test_broadcast_reports_each_target(network: Network) -> None:
    replies = network.server.broadcast(["site-1", "site-2", "site-404"], "test", "pid", timeout_s=20)

    assert [r.status for r in replies.values()] == [Status.OK, Status.OK, Status.UNREACHABLE]
    assert replies["site-1"].header["pid"] != replies["site-2"].header["pid"]


def test_large_body_is_not_joined_or_copied_into_msgpack() -> None:
    # Liveness is only seen between whole frames, so the heartbeat timeout must outlast the
    # transfer of the largest frame: this test gets its own, slower-heartbeat cells.
    harness = Harness(CellSettings(heartbeat_interval_s=1.0, heartbeat_timeout_s=20.0))
    try:
        server = harness.cell("server")
        harness.peer("site-1", connect=server.endpoint)
        size = 256 << 20

        reply = server.request("site-1", "test", "blob", header={"n": size}, timeout_s=60)

        (frame,) = reply.frames
        assert frame.nbytes == size
        assert frame[:3].tobytes() == bytes([0, 1, 2])
        assert frame[-1] == (size - 1) % 251
    finally:
        harness.close()
