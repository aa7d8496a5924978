"""Fuzzing the cell envelope: frame 0 of every message a cell receives from the network.

`decode_envelope` must return an `Envelope` or raise `CellProtocolError`, nothing else; an
envelope it accepts must encode again to an equal one. The protocol cores built on it must
never raise at all: a broken message is answered with an error status or counted.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.cells.client_core import ClientCore
from engine.cells.core import CellCore, Send
from engine.cells.envelope import Envelope, decode_envelope, encode_envelope
from engine.cells.handlers import HandlerRegistry
from engine.cells.message import Reply
from engine.cells.pending import PendingRequests
from engine.cells.protocol import MAX_HEADER_BYTES, Kind, Status
from engine.cells.server_core import ServerCore
from engine.cells.settings import CellSettings
from engine.errors import CellProtocolError

from .strategies import EDGE_INTS, FUZZ, MSGPACK_VALUES, mutated

NAMES = st.sampled_from(["server", "site-1", "site-1.job-7", "alice.3f9a", ""]) | st.from_regex(
    r"[A-Za-z0-9][A-Za-z0-9_-]{0,8}(\.[A-Za-z0-9_-]{1,5}){0,2}", fullmatch=True
)
HEADERS = st.dictionaries(st.text(max_size=8), MSGPACK_VALUES, max_size=4)
ENVELOPES = st.builds(
    Envelope,
    kind=st.sampled_from(Kind),
    msg_id=st.integers(0, 2**64 - 1),
    source=NAMES.filter(bool),
    target=NAMES,
    channel=st.text(max_size=10),
    topic=st.text(max_size=10),
    reply_to=st.none() | st.integers(0, 2**64 - 1),
    status=st.sampled_from([Status.OK, Status.ERROR, Status.TIMEOUT, Status.UNREACHABLE]),
    reason=st.text(max_size=20),
    timeout_ms=st.integers(0, 2**32),
    header=HEADERS,
)
VALID_FIELDS = ENVELOPES.map(lambda e: msgpack.unpackb(encode_envelope(e), raw=False))


@st.composite
def fields_with_wrong_values(draw: st.DrawFn) -> bytes:
    """A valid envelope's 12 fields with some replaced by any msgpack value, some added or dropped."""
    fields: list[Any] = draw(VALID_FIELDS)
    for _ in range(draw(st.integers(1, 3))):
        index = draw(st.integers(0, len(fields) - 1)) if fields else 0
        change = draw(st.sampled_from(["replace", "replace", "edge", "drop", "add"]))
        if change == "replace" and fields:
            fields[index] = draw(MSGPACK_VALUES)
        elif change == "edge" and fields:
            fields[index] = draw(EDGE_INTS | EDGE_INTS.filter(lambda n: n <= 2**63).map(lambda n: -n))
        elif change == "drop" and fields:
            del fields[index]
        else:
            fields.insert(index, draw(MSGPACK_VALUES))
    return msgpack.packb(fields, use_bin_type=True)


FRAMES = mutated(ENVELOPES.map(encode_envelope)) | fields_with_wrong_values() | st.binary(max_size=64)


@FUZZ
@given(frame=FRAMES)
# Crash found by this property: an unhashable status (a list) raised TypeError from the lookup.
@example(frame=msgpack.packb([1, 1, 5, "a", "b", "c", "t", None, [1], "", 0, {}]))
@example(frame=msgpack.packb([1, 1, 5, "a", "b", "c", "t", None, {"ok": 1}, "", 0, {}]))
@example(frame=b"\x91" * 5000 + b"\x01")  # nesting past msgpack's stack
@example(frame=b"\xdd\xff\xff\xff\xff")  # an array declaring 4 billion fields
# A NaN in the header round-trips, though NaN != NaN: compared by what it reads as.
@example(frame=msgpack.packb([1, 1, 0, "server", "server", "", "", None, "ok", "", 0, {"": float("nan")}]))
def test_decode_envelope_returns_an_envelope_or_raises_protocol_error(frame: bytes) -> None:
    try:
        envelope = decode_envelope(frame)
    except CellProtocolError as e:
        assert str(e)
        return
    again = decode_envelope(encode_envelope(envelope))
    assert again == envelope or repr(again) == repr(envelope)


def test_an_envelope_over_the_size_limit_is_refused_unread() -> None:
    frame = b"\x00" * (MAX_HEADER_BYTES + 1)

    with pytest.raises(CellProtocolError, match=rf"envelope of {MAX_HEADER_BYTES + 1} bytes exceeds"):
        decode_envelope(frame)


_ids = itertools.count(1)
SETTINGS = CellSettings(heartbeat_interval_s=1.0, heartbeat_timeout_s=3.0, max_message_size_bytes=4096)


def new_core(kind: type[CellCore], fqcn: str) -> CellCore:
    registry = HandlerRegistry()
    registry.register("test", "echo", lambda m: Reply(frames=m.frames))
    return kind(fqcn, SETTINGS, handlers=registry, pending=PendingRequests(fqcn), next_id=lambda: next(_ids))


@FUZZ
@given(
    messages=st.lists(
        st.tuples(st.sampled_from([b"r1", b"r2"]), FRAMES, st.lists(st.binary(max_size=5000), max_size=2)),
        min_size=1,
        max_size=4,
    ),
    hello_first=st.booleans(),
)
def test_server_core_answers_or_counts_every_message_and_never_raises(
    messages: list[tuple[bytes, bytes, list[bytes]]], hello_first: bool
) -> None:
    # Arrange: a server, with site-1 registered on r1 when a HELLO comes first
    core = new_core(ServerCore, "server")
    now_s = 10.0
    if hello_first:
        hello = Envelope(Kind.HELLO, 1, "site-1", "")
        core.on_frames(b"r1", [encode_envelope(hello)], now_s)

    for routing_id, frame, body in messages:
        # Act
        actions = core.on_frames(routing_id, [frame, *body], now_s)
        now_s += 0.5

        # Assert: every answer it sends is itself a well-formed envelope
        for action in actions:
            if isinstance(action, Send):
                decode_envelope(action.frames[0])
    core.on_tick(now_s + 100.0)


@FUZZ
@given(frames=st.lists(FRAMES, min_size=1, max_size=4))
def test_client_core_never_raises(frames: list[bytes]) -> None:
    core = new_core(ClientCore, "site-1")
    core.on_link_up(0.0)

    for index, frame in enumerate(frames):
        core.on_frames(None, [frame, b"body"], float(index))
    core.on_tick(100.0)


def test_an_unhashable_status_is_a_protocol_error() -> None:
    frame = msgpack.packb([1, 1, 5, "a", "b", "c", "t", None, [1], "", 0, {}])

    with pytest.raises(CellProtocolError, match=r"envelope status \[1\] is unknown"):
        decode_envelope(frame)
