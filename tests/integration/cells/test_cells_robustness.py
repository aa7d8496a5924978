"""Bad input from the network, over-size messages, and shutdown with requests outstanding."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from engine.cells import Cell, CellSettings, Message, Reply, Status
from engine.cells.envelope import Envelope, decode_envelope, encode_envelope
from engine.cells.protocol import Kind
from engine.errors import (
    CellClosedError,
    CellMessageTooLargeError,
    CellRemoteError,
    CellUnreachableError,
)

from .harness import Harness

MiB = 1 << 20


@pytest.fixture
def raw_context() -> Iterator[zmq.Context[Any]]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _fields(**overrides: Any) -> list[Any]:
    fields = {
        "version": 1,
        "kind": 1,
        "msg_id": 5,
        "source": "intruder",
        "target": "server",
        "channel": "test",
        "topic": "echo",
        "reply_to": None,
        "status": "ok",
        "reason": "",
        "timeout_ms": 0,
        "header": {},
    }
    fields.update(overrides)
    return list(fields.values())


GARBAGE = [
    pytest.param([b"\xc1\xc1"], "not valid msgpack", id="not-msgpack"),
    pytest.param([b""], "not valid msgpack", id="empty-frame"),
    pytest.param([msgpack.packb({"a": 1})], "array of 12 fields", id="map-not-array"),
    pytest.param([msgpack.packb([1, 2, 3])], "array of 12 fields", id="short-array"),
    pytest.param([msgpack.packb(_fields(version=99))], "version 99", id="wrong-version"),
    pytest.param([msgpack.packb(_fields(kind=42))], "kind 42", id="unknown-kind"),
    pytest.param([msgpack.packb(_fields(msg_id=-1))], "msg_id -1", id="negative-id"),
    pytest.param([msgpack.packb(_fields(source="bad name!"))], "source", id="bad-source"),
    pytest.param([msgpack.packb(_fields(status="closed"))], "status 'closed'", id="local-status-on-wire"),
    pytest.param([msgpack.packb(_fields(header=[1]))], "header must be a map", id="bad-header"),
    pytest.param([msgpack.packb(_fields())], "not registered", id="request-without-hello"),
    pytest.param([b"\xff" * 64, b"body", b"more"], "not valid msgpack", id="junk-multipart"),
]


@pytest.mark.parametrize(("frames", "reason"), GARBAGE)
def test_garbage_from_raw_socket_is_answered_and_cell_keeps_serving(
    harness: Harness, raw_context: zmq.Context[Any], frames: list[bytes], reason: str
) -> None:
    server = harness.cell("server")
    server.register_handler("test", "echo", lambda m: Reply(frames=m.frames))
    client = harness.cell("site-1", connect_to=server.endpoint)
    raw = raw_context.socket(zmq.DEALER)
    raw.connect(server.endpoint)

    raw.send_multipart(frames)

    assert raw.poll(10_000), "no answer to garbage"
    answer = decode_envelope(raw.recv_multipart()[0])
    assert answer.kind is Kind.REPLY and answer.status is Status.ERROR
    assert reason in answer.reason
    reply = client.request("server", "test", "echo", frames=[b"alive"], timeout_s=10)
    assert bytes(reply.frames[0]) == b"alive"


def test_spoofed_source_is_refused(harness: Harness, raw_context: zmq.Context[Any]) -> None:
    server = harness.cell("server")
    server.register_handler("test", "echo", lambda m: Reply())
    raw = raw_context.socket(zmq.DEALER)
    raw.connect(server.endpoint)
    raw.send(encode_envelope(Envelope(Kind.HELLO, 1, "site-7", "")))
    assert raw.poll(10_000) and decode_envelope(raw.recv()).status is Status.OK

    raw.send(encode_envelope(Envelope(Kind.REQUEST, 2, "site-8", "server", "test", "echo")))

    assert raw.poll(10_000)
    answer = decode_envelope(raw.recv())
    assert answer.status is Status.ERROR and "not the name this connection registered" in answer.reason
    assert server.stats()["spoofed_source"] == 1


def test_garbage_from_the_server_side_does_not_kill_a_client(harness: Harness, raw_context: zmq.Context[Any]) -> None:
    router = raw_context.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    client = harness.cell("site-1", connect_to=router.getsockopt_string(zmq.LAST_ENDPOINT), wait=False)
    client.register_handler("test", "echo", lambda m: Reply(header={"ok": 1}))
    assert router.poll(10_000)
    routing_id, hello = router.recv_multipart()
    assert decode_envelope(hello).kind is Kind.HELLO

    router.send_multipart([routing_id, b"\xc1 junk"])
    router.send_multipart([routing_id, msgpack.packb([1, 2])])
    ack = Envelope(Kind.HELLO_ACK, 1, "server", "site-1")
    router.send_multipart([routing_id, encode_envelope(ack)])
    request = Envelope(Kind.REQUEST, 2, "server", "site-1", "test", "echo")
    router.send_multipart([routing_id, encode_envelope(request)])

    deadline = time.monotonic() + 10
    while True:
        assert router.poll(max(0, int((deadline - time.monotonic()) * 1000))), "no reply"
        answer = decode_envelope(router.recv_multipart()[1])
        if answer.kind is Kind.REPLY:
            break
    assert answer.reply_to == 2 and dict(answer.header) == {"ok": 1}
    assert client.stats()["malformed"] == 2


def test_message_over_own_limit_is_refused_before_sending(harness: Harness) -> None:
    server = harness.cell("server")
    small = CellSettings(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, max_message_size_bytes=MiB)
    client = harness.cell("site-1", connect_to=server.endpoint, settings=small)

    with pytest.raises(CellMessageTooLargeError, match=r"'server'.*max_message_size_bytes=1048576"):
        client.request("server", "test", "echo", frames=[bytes(2 * MiB)], timeout_s=10)
    with pytest.raises(CellMessageTooLargeError):
        client.send("server", "test", "echo", frames=[bytes(2 * MiB)])


def _limited_server(harness: Harness, limit_bytes: int) -> tuple[Cell, Cell]:
    settings = CellSettings(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, max_message_size_bytes=limit_bytes)
    server = harness.cell("server", settings=settings)
    server.register_handler("test", "echo", lambda m: Reply(frames=m.frames))
    client = harness.cell("site-1", connect_to=server.endpoint)  # limit 1 GiB
    return server, client


def test_frame_over_receiver_limit_fails_fast_and_link_recovers(harness: Harness) -> None:
    _, client = _limited_server(harness, MiB)
    start = time.monotonic()

    with pytest.raises(CellUnreachableError, match="max_message_size_bytes"):
        client.request("server", "test", "echo", frames=[bytes(2 * MiB)], timeout_s=30)

    assert time.monotonic() - start < 5
    assert client.wait_connected(10), "client did not reconnect after the refusal"
    reply = client.request("server", "test", "echo", frames=[b"small"], timeout_s=10)
    assert bytes(reply.frames[0]) == b"small"


def test_message_over_receiver_limit_in_several_frames_gets_error_reply(harness: Harness) -> None:
    server, client = _limited_server(harness, MiB)

    with pytest.raises(CellRemoteError, match=r"exceeds max_message_size_bytes=1048576"):
        client.request("server", "test", "echo", frames=[bytes(MiB // 2)] * 3, timeout_s=10)

    assert server.stats()["too_large"] == 1


def test_reply_over_requester_limit_fails_fast(harness: Harness) -> None:
    server = harness.cell("server")
    server.register_handler("test", "big", lambda m: Reply(frames=[bytes(2 * MiB)]))
    small = CellSettings(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, max_message_size_bytes=MiB)
    client = harness.cell("site-1", connect_to=server.endpoint, settings=small)
    start = time.monotonic()

    with pytest.raises(CellUnreachableError):
        client.request("server", "test", "big", timeout_s=30)

    assert time.monotonic() - start < 5


def test_reply_over_replier_limit_becomes_error_reply(harness: Harness) -> None:
    server, client = _limited_server(harness, MiB)
    server.register_handler("test", "big", lambda m: Reply(frames=[bytes(2 * MiB)]))

    with pytest.raises(CellRemoteError, match="reply of handler .* refused"):
        client.request("server", "test", "big", timeout_s=10)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """An event that stuck handlers wait on; set at teardown so their threads end."""
    event = threading.Event()
    yield event
    event.set()


def _collect_outcomes(calls: list[Callable[[], Message]]) -> tuple[list[BaseException | None], list[threading.Thread]]:
    outcomes: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            calls[i]()
        except BaseException as e:  # inspected by the test
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    return outcomes, threads


def test_client_stop_with_requests_outstanding_is_bounded(harness: Harness, release: threading.Event) -> None:
    server = harness.cell("server")
    server.register_handler("test", "stuck", lambda m: release.wait(60) and None)
    client = harness.cell("site-1", connect_to=server.endpoint)
    futures = [client.request_async("server", "test", "stuck", timeout_s=60) for _ in range(3)]
    outcomes, threads = _collect_outcomes([lambda: client.request("server", "test", "stuck", timeout_s=60)] * 3)
    time.sleep(0.3)
    start = time.monotonic()

    client.stop(timeout_s=2.0)

    assert time.monotonic() - start < 3.0
    for thread in threads:
        thread.join(5)
    assert all(isinstance(o, CellClosedError) for o in outcomes), outcomes
    assert all(f.result(5).status is Status.CLOSED for f in futures)
    with pytest.raises(CellClosedError, match="not running"):
        client.request("server", "test", "stuck", timeout_s=1)


def test_server_stop_with_handlers_stuck_is_bounded(harness: Harness, release: threading.Event) -> None:
    server = harness.cell("server")
    server.register_handler("test", "stuck", lambda m: release.wait(60) and None)
    client = harness.cell("site-1", connect_to=server.endpoint)
    outcomes, threads = _collect_outcomes([lambda: client.request("server", "test", "stuck", timeout_s=60)] * 4)
    time.sleep(0.3)
    start = time.monotonic()

    server.stop(timeout_s=1.0)

    assert time.monotonic() - start < 2.0
    for thread in threads:
        thread.join(5)
    assert all(isinstance(o, CellUnreachableError) for o in outcomes), outcomes
    assert "stopped" in str(outcomes[0])


def test_server_stop_sends_the_reply_of_a_handler_that_is_finishing(harness: Harness) -> None:
    # The server runtime tells a client "the job ended" in a reply and stops its cell right
    # after; that reply must reach the client, or the client waits for a server that is gone.
    server = harness.cell("server")
    running = threading.Event()

    def slow_answer(message: Message) -> Reply:
        running.set()
        time.sleep(0.3)
        return Reply(header={"state": "end"})

    server.register_handler("test", "slow", slow_answer)
    client = harness.cell("site-1", connect_to=server.endpoint)
    future = client.request_async("server", "test", "slow", timeout_s=10)
    assert running.wait(5)

    server.stop(timeout_s=5.0)

    reply = future.result(5)
    assert reply.status is Status.OK, reply.reason
    assert reply.header == {"state": "end"}


def test_stop_from_a_handler_does_not_deadlock(harness: Harness) -> None:
    server = harness.cell("server")
    client = harness.cell("site-1", connect_to=server.endpoint)
    stopped = threading.Event()

    def stop_myself(message: Message) -> None:
        client.stop(timeout_s=2.0)
        stopped.set()

    client.register_handler("test", "stop", stop_myself)
    server.send("site-1", "test", "stop")

    assert stopped.wait(10), "stop() called from a handler did not return"
    assert not client.connected


def test_blocking_request_from_a_future_callback_is_refused(harness: Harness) -> None:
    server = harness.cell("server")
    attached = threading.Event()  # the reply waits until the callback is attached
    server.register_handler("test", "echo", lambda m: Reply())
    server.register_handler("test", "held", lambda m: attached.wait(10) and None)
    client = harness.cell("site-1", connect_to=server.endpoint)
    errors: list[BaseException] = []
    done = threading.Event()

    def callback(future: Any) -> None:
        try:
            client.request("server", "test", "echo", timeout_s=5)
        except BaseException as e:  # inspected below
            errors.append(e)
        done.set()

    client.request_async("server", "test", "held", timeout_s=15).add_done_callback(callback)
    attached.set()

    assert done.wait(10)
    assert errors and "would block it; use request_async" in str(errors[0])
