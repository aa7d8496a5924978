"""The protocol state machine of a cell, free of sockets and threads (sans-I/O).

The I/O thread (:mod:`engine.cells.io_thread`) feeds a core events — frames received, messages
queued by the API, link changes, timer ticks, failed sends — and carries out the actions it
returns: :class:`Send` frames on the wire, or :class:`Dispatch` a message to a handler. Unit
tests drive a core with plain bytes.

This module holds what server and client share (local delivery, answers, size checks, request
deadlines); :mod:`engine.cells.server_core` and :mod:`engine.cells.client_core` add routing
and liveness for each role. Nothing a peer sends makes a core raise: a broken message is
answered with an error status when there is somebody to answer, and counted and logged
otherwise.
"""

from __future__ import annotations

import abc
import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from engine.cells.envelope import Envelope, decode_envelope, encode_envelope
from engine.cells.handlers import Handler, HandlerRegistry
from engine.cells.log_limit import REFUSALS
from engine.cells.message import Message
from engine.cells.pending import PendingRequests
from engine.cells.protocol import MAX_POLL_WAIT_S, Kind, Status
from engine.cells.settings import CellSettings
from engine.errors import CellProtocolError

logger = logging.getLogger(__name__)


class Send(NamedTuple):
    """Action: put a message on the wire.

    Attributes:
        routing_id: Connection to send on (server), or None for the client's connection.
        frames: Envelope frame then body frames, sent zero-copy.
        envelope: The decoded envelope, to report a failed send.
        relayed: True when the server forwards another cell's message.
    """

    routing_id: bytes | None
    frames: Sequence[Any]
    envelope: Envelope
    relayed: bool = False


class Dispatch(NamedTuple):
    """Action: run ``handler`` on ``message`` in the handler pool."""

    handler: Handler
    message: Message


Action = Send | Dispatch


class CellCore(abc.ABC):
    """What every cell does with messages, whatever its role.

    Args:
        fqcn: Name of the cell.
        settings: Its settings.
        handlers: Handler registry consulted for local delivery.
        pending: Table of this cell's outstanding requests.
        next_id: Returns a fresh message id (thread-safe).
        endpoint: Where the server is (client) or listens (server), for messages.
    """

    is_server: bool = False
    #: Client: why the server last refused this cell (handshake or registration), None once in.
    link_error: str | None = None

    def __init__(
        self,
        fqcn: str,
        settings: CellSettings,
        *,
        handlers: HandlerRegistry,
        pending: PendingRequests,
        next_id: Callable[[], int],
        endpoint: str = "",
    ) -> None:
        self.fqcn = fqcn
        self.endpoint = endpoint
        self.connected = threading.Event()
        self._settings = settings
        self._handlers = handlers
        self._pending = pending
        self._next_id = next_id
        self._stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()
        self._tick_period_s = min(settings.heartbeat_interval_s / 2, MAX_POLL_WAIT_S)
        self._next_sweep_s = 0.0

    # ----------------------------------------------------------------- introspection

    @property
    def link_up(self) -> bool:
        """Client: registered with the server and hearing from it. Server: always True."""
        return self.connected.is_set()

    def peer_names(self) -> tuple[str, ...]:
        """FQCNs registered with this cell (a server); empty for a client."""
        return ()

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a named counter (thread-safe)."""
        with self._stats_lock:
            self._stats[name] += amount

    def stats(self) -> dict[str, int]:
        """Return a copy of the counters (malformed, no_handler, late_replies, ...)."""
        with self._stats_lock:
            return dict(self._stats)

    def next_timer_s(self, now_s: float) -> float:
        """Return the monotonic time at which :meth:`on_tick` is next due."""
        due = min(self._next_sweep_s, now_s + self._tick_period_s)
        deadline = self._pending.next_deadline_s()
        return due if deadline is None else min(due, deadline)

    # ----------------------------------------------------------------- events

    def on_frames(
        self, routing_id: bytes | None, frames: Sequence[Any], now_s: float, identity: str | None = None
    ) -> list[Action]:
        """Handle one received message: envelope frame plus body frames.

        Args:
            routing_id: The connection it came on (server), or None (client).
            frames: The frames after the routing id.
            now_s: Monotonic time of receipt.
            identity: The identity the allowlist gave the connection's CURVE key (a secure
                server), None otherwise.
        """
        if not frames:
            self.count("malformed")
            return []
        try:
            envelope = decode_envelope(frames[0])
        except CellProtocolError as e:
            self.count("malformed")
            REFUSALS.warning(logger, "malformed message: cell=%s error=%s", self.fqcn, e)
            if routing_id is None:
                return []
            answer = Envelope(
                Kind.REPLY,
                self._next_id(),
                self.fqcn,
                "",
                status=Status.ERROR,
                reason=f"{self.fqcn}: malformed message: {e}",
            )
            return [Send(routing_id, [encode_envelope(answer)], answer)]
        return self._received(routing_id, envelope, frames, now_s, identity)

    def on_outgoing(self, envelope: Envelope, frames: Sequence[Any], now_s: float) -> list[Action]:
        """Route a message made by this cell (request, send or handler reply)."""
        return self._route(envelope, frames, now_s)

    def on_send_failed(self, send: Send, reason: str, peer_gone: bool, now_s: float) -> list[Action]:
        """Handle a send the socket refused.

        Args:
            send: The action that failed.
            reason: Why, for messages and logs.
            peer_gone: True when the connection no longer exists (``EHOSTUNREACH``).
            now_s: Monotonic time.
        """
        envelope = send.envelope
        if envelope.kind in (Kind.HELLO, Kind.BYE, Kind.HELLO_ACK):
            # Hellos repeat every heartbeat; a bye or ack to a gone peer has nobody to tell.
            logger.debug("%s not sent: cell=%s %s", envelope.kind.name, self.fqcn, reason)
            return []
        self.count("send_failures")
        why = f"{self.fqcn}: cannot send to {envelope.target!r}: {reason}"
        if envelope.kind is Kind.REQUEST:
            if send.relayed:
                return self._answer(envelope, Status.UNREACHABLE, why, now_s)
            self._pending.fail(envelope.msg_id, Status.UNREACHABLE, why)
            return []
        logger.warning("message dropped: kind=%s %s", envelope.kind.name, why)
        return []

    def on_link_up(self, now_s: float) -> list[Action]:
        """A connection to the server completed its handshake (client cells only)."""
        return []

    def on_handshake_failed(self, reason: str, now_s: float) -> list[Action]:
        """A connection to the server failed its security handshake (client cells only)."""
        return []

    def on_link_down(self, reason: str, now_s: float) -> list[Action]:
        """The link to the server is down: it said bye or went silent (client cells only)."""
        return []

    def on_disconnected(self, reason: str, now_s: float) -> list[Action]:
        """The connection to the server closed (client cells only); the link is down too."""
        return self.on_link_down(reason, now_s)

    def on_tick(self, now_s: float) -> list[Action]:
        """Run timers: request deadlines every call, role sweeps every tick period."""
        self._pending.expire(now_s)
        if now_s < self._next_sweep_s:
            return []
        self._next_sweep_s = now_s + self._tick_period_s
        return self._sweep(now_s)

    def forget_peer(self, fqcn: str, reason: str) -> list[Action]:
        """Unregister ``fqcn`` now and fail the requests waiting for it (a server's; a client has no peers)."""
        return []

    @abc.abstractmethod
    def close(self) -> list[Action]:
        """Say goodbye to peers and fail every outstanding request with status closed."""

    # ----------------------------------------------------------------- role hooks

    @abc.abstractmethod
    def _received(
        self, routing_id: bytes | None, envelope: Envelope, frames: Sequence[Any], now_s: float, identity: str | None
    ) -> list[Action]:
        """Handle a message whose envelope decoded."""

    @abc.abstractmethod
    def _route_remote(self, envelope: Envelope, frames: Sequence[Any], now_s: float) -> list[Action]:
        """Send a message of this cell to another cell."""

    @abc.abstractmethod
    def _sweep(self, now_s: float) -> list[Action]:
        """Periodic liveness work."""

    # ----------------------------------------------------------------- shared helpers

    def _fail_all(self) -> None:
        self._pending.fail_where(lambda e: True, Status.CLOSED, f"cell {self.fqcn!r} stopped before the reply came")

    def _route(self, envelope: Envelope, frames: Sequence[Any], now_s: float) -> list[Action]:
        if envelope.target == self.fqcn:
            return self._deliver(envelope, frames, now_s)
        return self._route_remote(envelope, frames, now_s)

    def _deliver(self, envelope: Envelope, frames: Sequence[Any], now_s: float) -> list[Action]:
        """Hand a message for this cell to its pending request or its handler."""
        body = tuple(map(memoryview, frames[1:])) if len(frames) > 1 else ()
        if envelope.kind is Kind.REPLY:
            if not self._pending.resolve(Message(envelope, body)):
                self.count("late_replies")
                logger.debug("reply without pending request: from=%s reply_to=%s", envelope.source, envelope.reply_to)
            return []
        if envelope.kind is not Kind.REQUEST and envelope.kind is not Kind.SEND:
            self.count("unexpected_kind")
            return []
        handler = self._handlers.find(envelope.channel, envelope.topic)
        if handler is None:
            self.count("no_handler")
            return self._refuse(
                envelope, f"{self.fqcn}: no handler for channel={envelope.channel!r} topic={envelope.topic!r}", now_s
            )
        return [Dispatch(handler, Message(envelope, body))]

    def _undeliverable(self, envelope: Envelope, reason: str, now_s: float) -> list[Action]:
        """A message cannot reach its target: fail, answer, or drop it."""
        if envelope.kind is Kind.REQUEST and envelope.source == self.fqcn:
            self._pending.fail(envelope.msg_id, Status.UNREACHABLE, reason)
            return []
        if envelope.kind is Kind.REQUEST:
            return self._answer(envelope, Status.UNREACHABLE, reason, now_s)
        self.count("undeliverable")
        REFUSALS.warning(logger, "message dropped: kind=%s from=%s %s", envelope.kind.name, envelope.source, reason)
        return []

    def _refuse(self, envelope: Envelope, reason: str, now_s: float) -> list[Action]:
        """Answer a request with status error; count and log anything else."""
        if envelope.kind is Kind.REQUEST:
            REFUSALS.warning(logger, "request refused: from=%s %s", envelope.source, reason)
            return self._answer(envelope, Status.ERROR, reason, now_s)
        self.count("refused")
        REFUSALS.warning(logger, "message refused: kind=%s from=%s %s", envelope.kind.name, envelope.source, reason)
        return []

    def _answer(self, request: Envelope, status: Status, reason: str, now_s: float) -> list[Action]:
        answer = request.reply(self._next_id(), status, reason)
        return self._route(answer, [encode_envelope(answer)], now_s)

    def _size_problem(self, envelope: Envelope, frames: Sequence[Any]) -> str:
        """Return why a received message is too large, or an empty string."""
        limit = self._settings.max_message_size_bytes
        size = sum([memoryview(f).nbytes for f in frames]) if len(frames) > 1 else memoryview(frames[0]).nbytes
        if size <= limit:
            return ""
        self.count("too_large")
        return f"{self.fqcn}: message of {size} bytes from {envelope.source!r} exceeds max_message_size_bytes={limit}"
