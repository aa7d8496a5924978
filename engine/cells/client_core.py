"""Protocol logic of a client cell: registering with the server and watching the link.

A client sends HELLO as soon as a connection completes its handshake and then every
``heartbeat_interval_s`` while that connection lasts (none while there is no connection: they
would queue in the socket and reach the server in a burst); the server answers each with
HELLO_ACK. The link counts as up from the first ok HELLO_ACK until the connection drops, the
server says BYE, or nothing arrives from the server for ``heartbeat_timeout_s``. While it is
down, requests fail at once as unreachable (the core refuses them, so nothing queues for a
server that is not there), and the requests in flight fail as soon as it goes down, after
whatever the server sent before it went is taken.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from engine.cells.core import Action, CellCore, Send
from engine.cells.envelope import Envelope, encode_envelope
from engine.cells.handlers import HandlerRegistry
from engine.cells.pending import PendingRequests
from engine.cells.protocol import Kind, Status
from engine.cells.settings import CellSettings

logger = logging.getLogger(__name__)


class ClientCore(CellCore):
    """A cell that reaches every other cell through the server; see ``CellCore`` for args."""

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
        super().__init__(fqcn, settings, handlers=handlers, pending=pending, next_id=next_id, endpoint=endpoint)
        self._next_hello_s = 0.0
        self._last_server_s = 0.0
        self._server_fqcn = ""
        self._connection_open = False

    def on_handshake_failed(self, reason: str, now_s: float) -> list[Action]:
        """Remember why the server would not let this cell in; logged once per new reason."""
        if reason != self.link_error:
            logger.error("security handshake failed: cell=%s server=%s reason=%s", self.fqcn, self.endpoint, reason)
        self.link_error = reason
        self.count("handshake_failures")
        return []

    def on_link_up(self, now_s: float) -> list[Action]:
        """A connection to the server completed its handshake: say hello at once."""
        self._connection_open = True
        self.link_error = None
        self._next_hello_s = now_s + self._settings.heartbeat_interval_s
        return [self._hello()]

    def on_disconnected(self, reason: str, now_s: float) -> list[Action]:
        """The connection itself closed: no hellos until the next one completes its handshake."""
        self._connection_open = False
        return self.on_link_down(reason, now_s)

    def on_link_down(self, reason: str, now_s: float) -> list[Action]:
        """The connection to the server is gone: fail every request waiting on it."""
        was_up = self.connected.is_set()
        self.connected.clear()
        failed = self._pending.fail_where(lambda e: e.target != self.fqcn, Status.UNREACHABLE, reason)
        if was_up or failed:
            logger.warning("server link down: cell=%s failed_requests=%d reason=%s", self.fqcn, failed, reason)
        return []

    def close(self) -> list[Action]:
        """Send BYE to the server if it is reachable; fail requests with status closed."""
        actions: list[Action] = []
        if self.connected.is_set():
            bye = Envelope(Kind.BYE, self._next_id(), self.fqcn, self._server_fqcn)
            actions.append(Send(None, [encode_envelope(bye)], bye))
        self.connected.clear()
        self._fail_all()
        return actions

    # ----------------------------------------------------------------- role hooks

    def _received(
        self, routing_id: bytes | None, envelope: Envelope, frames: Sequence[Any], now_s: float, identity: str | None
    ) -> list[Action]:
        self._last_server_s = now_s
        kind = envelope.kind
        if kind is Kind.HELLO_ACK:
            self._on_hello_ack(envelope)
            return []
        if kind is Kind.BYE:  # the server stopped, or (reason given) it revoked this cell's key
            if envelope.reason:
                logger.error("server closed the registration: cell=%s reason=%s", self.fqcn, envelope.reason)
                self.link_error = envelope.reason
            why = envelope.reason or f"the server {envelope.source} stopped"
            return self.on_link_down(f"{self.fqcn}: {why}", now_s)
        if kind is Kind.HELLO:
            self.count("unexpected_kind")
            return []
        if envelope.target != self.fqcn:
            self.count("misrouted")
            return self._refuse(envelope, f"{self.fqcn}: message for {envelope.target!r} reached the wrong cell", now_s)
        too_large = self._size_problem(envelope, frames)
        if too_large:
            return self._refuse(envelope, too_large, now_s)
        return self._deliver(envelope, frames, now_s)

    def _route_remote(self, envelope: Envelope, frames: Sequence[Any], now_s: float) -> list[Action]:
        if not self.connected.is_set():
            return self._undeliverable(envelope, f"{self.fqcn}: not connected to the server at {self.endpoint}", now_s)
        return [Send(None, frames, envelope)]

    def _sweep(self, now_s: float) -> list[Action]:
        actions: list[Action] = []
        timeout_s = self._settings.heartbeat_timeout_s
        if self.connected.is_set() and now_s - self._last_server_s > timeout_s:
            actions += self.on_link_down(f"{self.fqcn}: no message from the server for {timeout_s:g} s", now_s)
        if self._connection_open and now_s >= self._next_hello_s:
            self._next_hello_s = now_s + self._settings.heartbeat_interval_s
            actions.append(self._hello())
        return actions

    # ----------------------------------------------------------------- helpers

    def _on_hello_ack(self, envelope: Envelope) -> None:
        if envelope.status is not Status.OK:
            self.count("refused_hellos")
            error = f"the server refused the registration: {envelope.reason}"
            if error != self.link_error:
                logger.error("server refused registration: cell=%s reason=%s", self.fqcn, envelope.reason)
            self.link_error = error
        elif not self.connected.is_set():
            self._server_fqcn = envelope.source
            self.connected.set()
            logger.info(
                "registered with server: cell=%s server=%s endpoint=%s", self.fqcn, envelope.source, self.endpoint
            )

    def _hello(self) -> Send:
        hello = Envelope(Kind.HELLO, self._next_id(), self.fqcn, self._server_fqcn)
        return Send(None, [encode_envelope(hello)], hello)
