"""The protocol state machines, driven without sockets: a tiny in-memory wire links them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from engine.cells.client_core import ClientCore
from engine.cells.core import Action, CellCore, Dispatch, Send
from engine.cells.envelope import Envelope, decode_envelope, encode_envelope
from engine.cells.handlers import HandlerRegistry
from engine.cells.message import Reply
from engine.cells.pending import PendingRequests, ReplyFuture
from engine.cells.protocol import Kind, Status
from engine.cells.server_core import ServerCore
from engine.cells.settings import CellSettings

SETTINGS = CellSettings(heartbeat_interval_s=1.0, heartbeat_timeout_s=3.0, max_message_size_bytes=4096)
_ids = itertools.count(1000)


def _core(kind: type[CellCore], fqcn: str) -> CellCore:
    registry = HandlerRegistry()
    registry.register("test", "echo", lambda m: Reply(frames=m.frames))
    return kind(
        fqcn,
        SETTINGS,
        handlers=registry,
        pending=PendingRequests(fqcn),
        next_id=lambda: next(_ids),
        endpoint="tcp://test",
    )


class Wire:
    """Carries Send actions between one server core and client cores keyed by routing id."""

    def __init__(self) -> None:
        self.server = _core(ServerCore, "server")
        self.clients: dict[bytes, CellCore] = {}
        self.dispatched: list[Dispatch] = []
        self.dropped: list[Send] = []
        self.cut = False  # when True the wire loses every message
        self.now_s = 0.0

    def connect(self, fqcn: str, routing_id: bytes) -> CellCore:
        client = _core(ClientCore, fqcn)
        self.clients[routing_id] = client
        self.run(client, client.on_link_up(self.now_s))
        assert client.link_up
        return client

    def run(self, source: CellCore, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, Dispatch):
                self.dispatched.append(action)
            elif self.cut:
                self.dropped.append(action)
            elif source is self.server:
                client = self.clients.get(action.routing_id)
                if client is None:
                    self.dropped.append(action)
                else:
                    self.run(client, client.on_frames(None, action.frames, self.now_s))
            else:
                routing_id = next(r for r, c in self.clients.items() if c is source)
                self.run(self.server, self.server.on_frames(routing_id, action.frames, self.now_s))

    def request(
        self, source: CellCore, target: str, topic: str = "echo", frames: Sequence[Any] = (b"body",)
    ) -> ReplyFuture:
        msg_id = next(_ids)
        future = source._pending.add(msg_id, target, "test", topic, self.now_s, 10.0)
        envelope = Envelope(Kind.REQUEST, msg_id, source.fqcn, target, "test", topic, timeout_ms=10_000)
        self.run(source, source.on_outgoing(envelope, [encode_envelope(envelope), *frames], self.now_s))
        return future

    def answer_dispatched(self) -> None:
        """Play the handler pool: echo every dispatched request back."""
        while self.dispatched:
            message = self.dispatched.pop(0).message
            cell = self._cell_named(message.target)
            reply = message.envelope.reply(next(_ids))
            self.run(cell, cell.on_outgoing(reply, [encode_envelope(reply), *message.frames], self.now_s))

    def _cell_named(self, fqcn: str) -> CellCore:
        cells = [self.server, *self.clients.values()]
        return next(c for c in cells if c.fqcn == fqcn)


@pytest.fixture
def wire() -> Wire:
    return Wire()


def test_hello_registers_and_acks(wire: Wire) -> None:
    wire.connect("site-1", b"r1")

    assert wire.server.peer_names() == ("site-1",)


def test_client_request_reaches_server_handler_with_zero_copy_views(wire: Wire) -> None:
    client = wire.connect("site-1", b"r1")
    body = bytearray(b"payload")

    future = wire.request(client, "server", frames=[body])

    (dispatch,) = wire.dispatched
    assert isinstance(dispatch.message.frames[0], memoryview)
    assert dispatch.message.frames[0].obj is body
    wire.answer_dispatched()
    assert bytes(future.result(0).frames[0]) == b"payload"


def test_client_to_client_goes_through_server_and_back(wire: Wire) -> None:
    site1 = wire.connect("site-1", b"r1")
    wire.connect("site-2", b"r2")

    future = wire.request(site1, "site-2")
    wire.answer_dispatched()

    reply = future.result(0)
    assert (reply.status, reply.source) == (Status.OK, "site-2")
    assert len(wire.server._relay) == 0


def test_relayed_request_is_answered_unreachable_when_target_expires(wire: Wire) -> None:
    site1 = wire.connect("site-1", b"r1")
    wire.connect("site-2", b"r2")
    future = wire.request(site1, "site-2")
    wire.dispatched.clear()  # site-2 never answers

    wire.now_s = 2.0
    wire.run(site1, site1.on_tick(wire.now_s))  # site-1 keeps saying hello; site-2 is silent
    wire.now_s = 3.5
    wire.run(wire.server, wire.server.on_tick(wire.now_s))

    reply = future.result(0)
    assert reply.status is Status.UNREACHABLE
    assert "no heartbeat from site-2" in reply.reason
    assert wire.server.peer_names() == ("site-1",)


def test_request_to_unknown_cell_is_unreachable(wire: Wire) -> None:
    site1 = wire.connect("site-1", b"r1")

    reply = wire.request(site1, "site-404").result(0)

    assert reply.status is Status.UNREACHABLE and "no cell named 'site-404'" in reply.reason


def test_no_handler_is_answered_with_error(wire: Wire) -> None:
    site1 = wire.connect("site-1", b"r1")

    reply = wire.request(site1, "server", topic="missing").result(0)

    assert reply.status is Status.ERROR and "no handler" in reply.reason
    assert wire.server.stats()["no_handler"] == 1


def test_too_large_message_is_refused_by_receiver(wire: Wire) -> None:
    site1 = wire.connect("site-1", b"r1")

    reply = wire.request(site1, "server", frames=[bytes(3000), bytes(3000)]).result(0)

    assert reply.status is Status.ERROR
    assert "exceeds max_message_size_bytes=4096" in reply.reason


@pytest.mark.parametrize(
    "frames",
    [[b"\xc1"], [b""], [], [b"\x93\x01\x02\x03", b"x"]],
    ids=["invalid-byte", "empty-frame", "no-frames", "short-array"],
)
def test_garbage_to_server_is_answered_on_its_connection(wire: Wire, frames: list[bytes]) -> None:
    actions = wire.server.on_frames(b"raw", frames, 0.0)

    if not frames:
        assert actions == []
    else:
        (send,) = actions
        assert send.routing_id == b"raw"
        assert decode_envelope(send.frames[0]).status is Status.ERROR
    assert wire.server.stats()["malformed"] == 1


def test_garbage_to_client_is_counted_not_answered(wire: Wire) -> None:
    client = wire.connect("site-1", b"r1")

    assert client.on_frames(None, [b"\xc1"], 0.0) == []
    assert client.stats()["malformed"] == 1


def test_request_before_hello_and_spoofed_source_are_refused(wire: Wire) -> None:
    wire.connect("site-1", b"r1")
    request = Envelope(Kind.REQUEST, 1, "site-1", "server", "test", "echo")

    (unregistered,) = wire.server.on_frames(b"other", [encode_envelope(request)], 0.0)
    spoof = Envelope(Kind.REQUEST, 2, "site-9", "server", "test", "echo")
    (spoofed,) = wire.server.on_frames(b"r1", [encode_envelope(spoof)], 0.0)

    assert "send HELLO first" in decode_envelope(unregistered.frames[0]).reason
    assert "not the name this connection registered" in decode_envelope(spoofed.frames[0]).reason


def test_reconnect_fails_what_was_in_flight_to_the_old_connection(wire: Wire) -> None:
    wire.connect("site-1", b"old")
    future = wire.request(wire.server, "site-1")
    wire.dispatched.clear()

    wire.connect("site-1", b"new")

    assert future.result(0).status is Status.UNREACHABLE
    assert "reconnected" in future.result(0).reason


def test_gone_connection_on_send_unregisters_peer(wire: Wire) -> None:
    wire.connect("site-1", b"r1")
    future = wire.request(wire.server, "site-1")
    wire.dispatched.clear()
    envelope = Envelope(Kind.REQUEST, 5, "server", "site-1", "test", "echo")

    wire.server.on_send_failed(Send(b"r1", [b""], envelope), "gone", True, 0.0)

    assert future.result(0).status is Status.UNREACHABLE
    assert wire.server.peer_names() == ()


def test_client_link_down_fails_pending_and_refuses_new_requests(wire: Wire) -> None:
    client = wire.connect("site-1", b"r1")
    wire.cut = True
    future = wire.request(client, "server")
    wire.dispatched.clear()

    client.on_link_down("connection lost", 0.0)

    assert future.result(0).status is Status.UNREACHABLE
    later = wire.request(client, "server").result(0)
    assert later.status is Status.UNREACHABLE and "not connected" in later.reason


def test_client_notices_a_silent_server(wire: Wire) -> None:
    client = wire.connect("site-1", b"r1")
    wire.cut = True

    client.on_tick(2.0)
    assert client.link_up
    client.on_tick(3.5)
    assert not client.link_up


def _hellos(actions: Sequence[Action]) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and a.envelope.kind is Kind.HELLO]


def test_client_says_hello_only_while_a_connection_is_open() -> None:
    client = _core(ClientCore, "site-1")

    assert _hellos(client.on_tick(0.0)) == _hellos(client.on_tick(5.0)) == []  # nothing would take them
    assert len(_hellos(client.on_link_up(6.0))) == 1
    assert _hellos(client.on_tick(6.5)) == []
    assert len(_hellos(client.on_tick(7.0))) == 1  # every heartbeat interval while connected
    client.on_disconnected("connection closed", 7.5)
    assert _hellos(client.on_tick(9.0)) == _hellos(client.on_tick(20.0)) == []
    assert len(_hellos(client.on_link_up(21.0))) == 1


def test_client_keeps_saying_hello_to_a_silent_server_on_an_open_connection(wire: Wire) -> None:
    client = wire.connect("site-1", b"r1")
    wire.cut = True

    client.on_tick(3.5)  # silent past the timeout: the link is down, the connection is not
    assert not client.link_up

    assert len(_hellos(client.on_tick(5.0))) == 1


def test_close_says_bye_and_fails_pending(wire: Wire) -> None:
    client = wire.connect("site-1", b"r1")
    future = wire.request(wire.server, "site-1")
    wire.dispatched.clear()

    wire.run(wire.server, wire.server.close())

    assert future.result(0).status is Status.CLOSED
    assert not client.link_up


def test_a_bye_with_a_reason_takes_the_link_down_and_says_why(wire: Wire) -> None:
    client = wire.connect("site-1", b"r1")
    wire.cut = True  # the request stays in flight
    pending = wire.request(client, "site-2")
    why = "server: the key of 'site-1' is no longer on the allowlist"
    bye = Envelope(Kind.BYE, next(_ids), "server", "site-1", reason=why)

    client.on_frames(None, [encode_envelope(bye)], wire.now_s)

    assert not client.link_up
    assert client.link_error == why
    assert pending.result(0).status is Status.UNREACHABLE and why in pending.result(0).reason


def test_late_reply_is_counted(wire: Wire) -> None:
    client = wire.connect("site-1", b"r1")
    late = Envelope(Kind.REPLY, 3, "server", "site-1", reply_to=424242)

    assert client.on_frames(None, [encode_envelope(late)], 0.0) == []
    assert client.stats()["late_replies"] == 1
