"""The envelope codec: round trips, and every way a frame from the network can be wrong."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from engine.cells.envelope import Envelope, decode_envelope, encode_envelope
from engine.cells.protocol import MAX_HEADER_BYTES, Kind, Status
from engine.errors import CellProtocolError


def _fields(**overrides: Any) -> list[Any]:
    fields = {
        "version": 1,
        "kind": 1,
        "msg_id": 5,
        "source": "site-1",
        "target": "server",
        "channel": "task",
        "topic": "get",
        "reply_to": None,
        "status": "ok",
        "reason": "",
        "timeout_ms": 0,
        "header": {},
    }
    fields.update(overrides)
    return list(fields.values())


def test_round_trip_keeps_every_field() -> None:
    envelope = Envelope(
        Kind.REPLY,
        2**64 - 1,
        "site-1.job",
        "server",
        "task",
        "get",
        reply_to=17,
        status=Status.UNREACHABLE,
        reason="gone",
        timeout_ms=1500,
        header={"round": 3, "blob": b"\x00", "n": [1, 2.5]},
    )

    assert decode_envelope(encode_envelope(envelope)) == envelope


def test_decodes_from_memoryview() -> None:
    envelope = Envelope(Kind.SEND, 1, "a", "b", "c", "d")

    assert decode_envelope(memoryview(encode_envelope(envelope))) == envelope


def test_reply_swaps_ends_and_echoes_channel_and_topic() -> None:
    request = Envelope(Kind.REQUEST, 9, "site-1", "site-2", "task", "get", timeout_ms=10)

    reply = request.reply(10, Status.ERROR, "boom", {"k": 1})

    assert (reply.kind, reply.source, reply.target, reply.reply_to) == (Kind.REPLY, "site-2", "site-1", 9)
    assert (reply.channel, reply.topic, reply.status, reply.reason) == ("task", "get", Status.ERROR, "boom")
    assert dict(reply.header) == {"k": 1}


@pytest.mark.parametrize("kind", [Kind.REPLY, Kind.HELLO, Kind.BYE], ids=lambda k: k.name)
def test_empty_target_allowed_where_nobody_can_be_named(kind: Kind) -> None:
    envelope = Envelope(kind, 1, "site-1", "")

    assert decode_envelope(encode_envelope(envelope)).target == ""


def test_encode_names_the_fix_for_an_unserializable_header() -> None:
    envelope = Envelope(Kind.REQUEST, 1, "site-1", "server", "task", "get", header={"model": object()})

    with pytest.raises(
        ValueError,
        match=r"'server' \(channel='task', topic='get'\).*body "
        "frames",
    ):
        encode_envelope(envelope)


MALFORMED = [
    pytest.param(b"\xc1", "not valid msgpack", id="not-msgpack"),
    pytest.param(b"", "not valid msgpack", id="empty"),
    pytest.param(msgpack.packb([1, 2]) + b"extra", "not valid msgpack", id="trailing-bytes"),
    pytest.param(msgpack.packb({"kind": 1}), "array of 12 fields", id="map"),
    pytest.param(msgpack.packb(_fields()[:-1]), "array of 12 fields", id="11-fields"),
    pytest.param(msgpack.packb(_fields(version=2)), "version 2", id="version"),
    pytest.param(msgpack.packb(_fields(kind=0)), "kind 0", id="kind-zero"),
    pytest.param(msgpack.packb(_fields(kind="request")), "kind 'request'", id="kind-str"),
    pytest.param(msgpack.packb(_fields(msg_id=True)), "msg_id True", id="id-bool"),
    pytest.param(msgpack.packb(_fields(msg_id=-3)), "msg_id -3", id="id-negative"),
    pytest.param(msgpack.packb(_fields(msg_id="7")), "msg_id '7'", id="id-str"),
    pytest.param(msgpack.packb(_fields(source="")), "source ''", id="source-empty"),
    pytest.param(msgpack.packb(_fields(source=b"site-1")), "source", id="source-bytes"),
    pytest.param(msgpack.packb(_fields(target="")), "target ''", id="request-no-target"),
    pytest.param(msgpack.packb(_fields(target="a b")), "target 'a b'", id="target-space"),
    pytest.param(msgpack.packb(_fields(channel=1)), "channel and topic", id="channel-int"),
    pytest.param(msgpack.packb(_fields(topic=None)), "channel and topic", id="topic-none"),
    pytest.param(msgpack.packb(_fields(reply_to="x")), "reply_to 'x'", id="reply-to-str"),
    pytest.param(msgpack.packb(_fields(status="fine")), "status 'fine'", id="status-unknown"),
    pytest.param(msgpack.packb(_fields(status="closed")), "status 'closed'", id="status-local"),
    pytest.param(msgpack.packb(_fields(reason=3)), "reason", id="reason-int"),
    pytest.param(msgpack.packb(_fields(timeout_ms=-1)), "timeout_ms -1", id="timeout-negative"),
    pytest.param(msgpack.packb(_fields(timeout_ms=1.5)), "timeout_ms 1.5", id="timeout-float"),
    pytest.param(msgpack.packb(_fields(header=[])), "header must be a map", id="header-list"),
    pytest.param(msgpack.packb(_fields(header={1: 2})), "not valid msgpack", id="header-int-key"),
    pytest.param(b"\x00" * (MAX_HEADER_BYTES + 1), "exceeds", id="too-big"),
]


@pytest.mark.parametrize(("frame", "message"), MALFORMED)
def test_malformed_frames_raise_protocol_error(frame: bytes, message: str) -> None:
    with pytest.raises(CellProtocolError, match=message):
        decode_envelope(frame)
