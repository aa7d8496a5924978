"""Protocol constants of the cells wire format, defined once.

A cell message is a ZeroMQ multipart message: frame 0 is a msgpack-encoded envelope (see
:mod:`engine.cells.envelope`), frames 1..n are body frames that the cells layer passes through
untouched. On a ROUTER socket a routing-id frame precedes frame 0; it is a ZeroMQ detail and never
an identity (identities live in :mod:`engine.cells.peers`).
"""

from __future__ import annotations

import enum

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the envelope layout."""

MAX_HEADER_BYTES = 1 << 20
"""Largest envelope frame (frame 0) accepted, in bytes; a bigger one is malformed."""

MAX_FQCN_CHARS = 255
"""Longest fully qualified cell name accepted."""

MAX_CELLS_PER_IDENTITY = 64
"""Most cell names one authenticated identity may have registered with a server at once (its
own and its children's): a site cannot fill the server's peer table by inventing child names."""

ANY_TOPIC = "*"
"""Topic that registers a handler for every topic of its channel not registered exactly."""

RECONNECT_INTERVAL_MS = 100
"""First delay before a client cell redials a lost server (ZMQ ``RECONNECT_IVL``)."""

RECONNECT_INTERVAL_MAX_MS = 1000
"""Cap of the exponential redial back-off (ZMQ ``RECONNECT_IVL_MAX``)."""

RECV_BATCH_MESSAGES = 64
"""Messages the I/O thread receives in one go before it looks at its outbox again."""

MAX_POLL_WAIT_S = 0.5
"""Longest the I/O thread sleeps in poll when no timer is due sooner."""

CLOSE_LINGER_MAX_S = 1.0
"""Cap, in seconds, on how long closing a socket may wait to flush queued messages."""

SETTLE_GRACE_S = 1.0
#: Seconds between two looks at a ``stop`` event while a wait (a reply, a reconnection, a pull) goes on.
STOP_POLL_S = 0.1
"""How long a request that timed out waits for a reply another thread took from the table just
before (and is setting on its future) instead of failing it: a moment, in practice."""

HANDLER_GRACE_MAX_S = 1.0
"""Cap, in seconds, on how long stopping a cell waits for running handlers before it closes
its sockets (at most half of the stop's own bound), so that their replies still go out."""


class Kind(enum.IntEnum):
    """What a message is for; the envelope's second field."""

    REQUEST = 1
    """Expects exactly one REPLY whose ``reply_to`` is this message's id."""
    REPLY = 2
    """Answers a REQUEST; carries a :class:`Status`."""
    SEND = 3
    """Fire and forget: delivered to a handler, never answered."""
    HELLO = 4
    """Client to server: registers the sender's FQCN; repeated as the client's heartbeat."""
    HELLO_ACK = 5
    """Server to client: answers every HELLO (status ok, or error with the refusal)."""
    BYE = 6
    """Either side is stopping; the receiver forgets the sender at once."""


class Status(str, enum.Enum):
    """Outcome carried by a reply.

    ``CLOSED`` never travels on the wire: it marks a request that this cell failed locally
    because it was stopped before the reply came.
    """

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    CLOSED = "closed"


WIRE_STATUSES = frozenset({Status.OK, Status.ERROR, Status.TIMEOUT, Status.UNREACHABLE})
"""Statuses a peer may put in an envelope."""
