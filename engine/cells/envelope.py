"""The envelope: frame 0 of every cell message, and its msgpack codec.

The envelope is a msgpack array rather than a map: it is decoded once per message on the I/O
thread, and positional fields keep it small and fast. Body frames never pass through msgpack.

Layout (index: field)::

    0 version  1 kind  2 msg_id  3 source  4 target  5 channel  6 topic
    7 reply_to  8 status  9 reason  10 timeout_ms  11 header
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import msgpack

from engine.cells.fqcn import is_valid_fqcn
from engine.cells.protocol import MAX_HEADER_BYTES, PROTOCOL_VERSION, WIRE_STATUSES, Kind, Status
from engine.errors import CellProtocolError

_FIELD_COUNT = 12
_MAX_ID = (1 << 64) - 1
_KINDS = {k.value: k for k in Kind}
_STATUSES = {s.value: s for s in WIRE_STATUSES}
# A client does not know the server's name before its first HELLO_ACK, and the answer to a
# message too broken to parse has nobody to name.
_ANONYMOUS_TARGET_KINDS = frozenset({Kind.REPLY, Kind.HELLO, Kind.BYE})
_NO_HEADER: Mapping[str, Any] = MappingProxyType({})
_packers = threading.local()


class Envelope(NamedTuple):
    """The routing and status fields of one message, plus the user's small header.

    A named tuple rather than a dataclass: one is built and one decoded per message, and a
    tuple is several times cheaper to make.

    Attributes:
        kind: What the message is for.
        msg_id: Id unique per source cell; a reply names it in ``reply_to``.
        source: FQCN of the cell that made the message.
        target: FQCN of the cell it is for; empty in a HELLO or BYE to a server whose name
            is not known yet, and in the answer to a message too broken to parse.
        channel: Handler channel, e.g. ``"task"``.
        topic: Handler topic within the channel, e.g. ``"get"``.
        reply_to: For a REPLY, the ``msg_id`` of the request it answers.
        status: Outcome, meaningful on REPLY and HELLO_ACK.
        reason: Human-readable cause of a non-ok status.
        timeout_ms: For a REQUEST, how long the requester waits (lets relays forget it).
        header: The user's header: a msgpack-serializable dict with string keys.
    """

    kind: Kind
    msg_id: int
    source: str
    target: str
    channel: str = ""
    topic: str = ""
    reply_to: int | None = None
    status: Status = Status.OK
    reason: str = ""
    timeout_ms: int = 0
    header: Mapping[str, Any] = _NO_HEADER

    def reply(
        self,
        msg_id: int,
        status: Status = Status.OK,
        reason: str = "",
        header: Mapping[str, Any] | None = None,
        source: str | None = None,
    ) -> Envelope:
        """Build the envelope that answers this one.

        Args:
            msg_id: Id of the reply itself (from the replying cell's counter).
            status: Outcome of the request.
            reason: Why, for a non-ok status.
            header: User header of the reply.
            source: Who answers; defaults to this envelope's target (the cell asked).

        Returns:
            A REPLY addressed to this envelope's source, echoing its channel and topic.
        """
        return Envelope(  # positional: one is made per request answered
            Kind.REPLY,
            msg_id,
            self.target if source is None else source,
            self.source,
            self.channel,
            self.topic,
            self.msg_id,
            status,
            reason,
            0,
            header if header is not None else _NO_HEADER,
        )


def encode_envelope(envelope: Envelope) -> bytes:
    """Encode an envelope into the bytes of frame 0.

    Args:
        envelope: The envelope; its header must be msgpack-serializable.

    Returns:
        The msgpack bytes.

    Raises:
        ValueError: If the user header cannot be serialized, naming the offending type.
    """
    packer: msgpack.Packer | None = getattr(_packers, "packer", None)
    if packer is None:  # a Packer holds a buffer: one per thread
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    header = envelope.header
    try:
        # The envelope's fields are in wire order after the version; its enums pack as their
        # int and str values (IntEnum and str Enum are int and str to msgpack).
        return packer.pack((PROTOCOL_VERSION, *envelope[:10], header if type(header) is dict else dict(header)))
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(
            f"header of message to {envelope.target!r} (channel={envelope.channel!r}, "
            f"topic={envelope.topic!r}) cannot be encoded: {e}; use only str keys and "
            "msgpack types (None, bool, int, float, str, bytes, list, dict); send large data "
            "as body frames"
        ) from e


def decode_envelope(frame: Any) -> Envelope:
    """Decode and validate frame 0 as received from the network.

    Args:
        frame: A bytes-like object (``bytes``, ``memoryview`` or ``zmq.Frame``).

    Returns:
        The envelope.

    Raises:
        CellProtocolError: If the frame is not a well-formed envelope; the message says which
            field is wrong.
    """
    view = memoryview(frame)
    if view.nbytes > MAX_HEADER_BYTES:
        raise CellProtocolError(f"envelope of {view.nbytes} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        fields = msgpack.unpackb(view, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise CellProtocolError(f"envelope is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(fields, list) or len(fields) != _FIELD_COUNT:
        raise CellProtocolError(
            f"envelope must be a msgpack array of {_FIELD_COUNT} fields, got {type(fields).__name__}"
        )
    return _envelope_from_fields(fields)


def _envelope_from_fields(fields: list[Any]) -> Envelope:
    (version, kind, msg_id, source, target, channel, topic, reply_to, status, reason, timeout_ms, header) = fields
    if version != PROTOCOL_VERSION:
        raise CellProtocolError(f"envelope version {version!r} is not supported (this cell speaks {PROTOCOL_VERSION})")
    if not isinstance(kind, int) or kind not in _KINDS:
        raise CellProtocolError(f"envelope kind {kind!r} is unknown")
    if not _is_id(msg_id):
        raise CellProtocolError(f"envelope msg_id {msg_id!r} is not an unsigned 64-bit integer")
    if not is_valid_fqcn(source):
        raise CellProtocolError(f"envelope source {source!r} is not a valid cell name")
    if not (is_valid_fqcn(target) or (target == "" and kind in _ANONYMOUS_TARGET_KINDS)):
        raise CellProtocolError(f"envelope target {target!r} is not a valid cell name")
    if not isinstance(channel, str) or not isinstance(topic, str):
        raise CellProtocolError("envelope channel and topic must be strings")
    if reply_to is not None and not _is_id(reply_to):
        raise CellProtocolError(f"envelope reply_to {reply_to!r} is not a message id")
    if not isinstance(status, str) or status not in _STATUSES:  # a list or map is unhashable
        raise CellProtocolError(f"envelope status {status!r} is unknown")
    if not isinstance(reason, str):
        raise CellProtocolError("envelope reason must be a string")
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms < 0:
        raise CellProtocolError(f"envelope timeout_ms {timeout_ms!r} is not a non-negative int")
    if not isinstance(header, dict):
        raise CellProtocolError(f"envelope header must be a map, got {type(header).__name__}")
    return Envelope(
        _KINDS[kind], msg_id, source, target, channel, topic, reply_to, _STATUSES[status], reason, timeout_ms, header
    )


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_ID
