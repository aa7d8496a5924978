"""What handlers receive (:class:`Message`) and return (:class:`Reply`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from engine.cells.envelope import Envelope
from engine.cells.protocol import Kind, Status
from engine.errors import (
    CellClosedError,
    CellError,
    CellRemoteError,
    CellTimeoutError,
    CellUnreachableError,
)

_STATUS_ERRORS: dict[Status, type[CellError]] = {
    Status.ERROR: CellRemoteError,
    Status.TIMEOUT: CellTimeoutError,
    Status.UNREACHABLE: CellUnreachableError,
    Status.CLOSED: CellClosedError,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """A received message: its envelope and its body frames, zero-copy.

    Body frames are memoryviews over the buffers ZeroMQ received into; they stay valid as long
    as a reference to them is held. They are never joined: a body of several frames arrives as
    several views.

    A message returned for a request always has ``source`` equal to the request's target, even
    when the failure was decided elsewhere (by this cell or by the server); ``reason`` then says
    who decided.

    Attributes:
        envelope: Routing and status fields plus the user header.
        frames: The body frames.
    """

    envelope: Envelope
    frames: tuple[memoryview, ...] = ()

    @property
    def kind(self) -> Kind:
        """What the message is for (request, reply or send)."""
        return self.envelope.kind

    @property
    def source(self) -> str:
        """FQCN of the sender."""
        return self.envelope.source

    @property
    def target(self) -> str:
        """FQCN of the receiver."""
        return self.envelope.target

    @property
    def channel(self) -> str:
        """Handler channel."""
        return self.envelope.channel

    @property
    def topic(self) -> str:
        """Handler topic."""
        return self.envelope.topic

    @property
    def header(self) -> Mapping[str, Any]:
        """The user header (a dict decoded from msgpack)."""
        return self.envelope.header

    @property
    def status(self) -> Status:
        """Outcome of a reply; ``ok`` on requests and sends."""
        return self.envelope.status

    @property
    def reason(self) -> str:
        """Why a reply is not ok."""
        return self.envelope.reason

    @property
    def body_bytes(self) -> int:
        """Total size of the body frames, in bytes."""
        frames = self.frames
        return sum([f.nbytes for f in frames]) if frames else 0

    @property
    def ok(self) -> bool:
        """True when the status is ok."""
        return self.envelope.status is Status.OK

    def raise_for_status(self) -> Message:
        """Return this message if its status is ok, else raise the matching error.

        Returns:
            This message.

        Raises:
            CellRemoteError: Status error (the peer's handler raised or refused the request).
            CellTimeoutError: Status timeout.
            CellUnreachableError: Status unreachable.
            CellClosedError: Status closed (this cell stopped first).
        """
        status = self.envelope.status
        if status is Status.OK:
            return self
        error = _STATUS_ERRORS[status]
        raise error(
            f"request to {self.source!r} (channel={self.channel!r}, topic={self.topic!r}) "
            f"failed with status {status.value}: {self.reason}"
        )


@dataclasses.dataclass(slots=True)
class Reply:
    """What a request handler returns; returning None means an empty ok reply.

    Body frames are sent zero-copy: do not modify their buffers after returning them.

    Attributes:
        header: User header of the reply (msgpack-serializable, string keys).
        frames: Body frames: any objects exposing the buffer protocol (bytes, memoryview,
            numpy arrays, ...).
        status: Outcome; a handler may refuse a request with ``Status.ERROR``.
        reason: Why, for a non-ok status.

    Example:
        >>> def get_chunk(message: Message) -> Reply:
        ...     start = message.header["offset"]
        ...     return Reply(header={"offset": start}, frames=[buffer[start:start + 2**21]])
    """

    header: Mapping[str, Any] | None = None
    frames: Sequence[Any] = ()
    status: Status = Status.OK
    reason: str = ""
