"""Protocol logic of the server cell: registration, routing between cells, peer liveness.

Every client cell connects to the server. The server binds each connection to the FQCN its
HELLO claims (:mod:`engine.cells.peers`), checks every later message against that binding,
forwards messages between cells, remembers forwarded requests (:mod:`engine.cells.relay`) so it
can answer for a target that vanishes, and forgets a cell that says BYE or stays silent for
``heartbeat_timeout_s``.

A secure server (``authenticated``) also knows each connection's identity, which ZeroMQ took
from its CURVE key through the allowlist: a connection may register only a name its identity
owns (``site-1``, ``site-1.job``; see :func:`~engine.cells.security.name_owned_by`), so the
source of every message it sends, forwarded ones included, is the authenticated one. A second
connection of the same identity that registers the same name replaces the first (a client that
reconnects after a network failure looks like that); the first one's messages are refused from
then on. When an identity leaves the allowlist, the server's next sweep (within
``min(heartbeat_interval_s / 2, 0.5)`` s) says BYE to each of its cells, with the reason, and
unregisters them; ZeroMQ keeps the connection itself, but every message on it is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from engine.cells.core import Action, CellCore, Send
from engine.cells.envelope import Envelope, encode_envelope
from engine.cells.handlers import HandlerRegistry
from engine.cells.log_limit import REFUSALS
from engine.cells.peers import PeerTable, Registration
from engine.cells.pending import PendingRequests
from engine.cells.protocol import MAX_CELLS_PER_IDENTITY, Kind, Status
from engine.cells.relay import RelayTable
from engine.cells.security import name_owned_by
from engine.cells.settings import CellSettings

logger = logging.getLogger(__name__)


class ServerCore(CellCore):
    """The routing hub; see :class:`~engine.cells.core.CellCore` for the arguments.

    Args:
        authenticated: True when every connection carries an identity from its CURVE key (the
            cell has an allowlist); a message without one is then refused.
        still_allowed: Whether an authenticated identity is still on the allowlist; the cells
            of an identity revoked since its handshake are told BYE and unregistered at the
            next sweep, and every further message of its connections is refused. None: never
            revoked.
        owns: Whether an identity may use a cell name: `name_owned_by`, or the allowlist's
            `~engine.cells.security.Allowlist.owns` (names delegated to a simulation's workers too).
    """

    is_server = True

    def __init__(
        self,
        fqcn: str,
        settings: CellSettings,
        *,
        handlers: HandlerRegistry,
        pending: PendingRequests,
        next_id: Callable[[], int],
        endpoint: str = "",
        authenticated: bool = False,
        still_allowed: Callable[[str], bool] | None = None,
        owns: Callable[[str, str], bool] = name_owned_by,
    ) -> None:
        super().__init__(fqcn, settings, handlers=handlers, pending=pending, next_id=next_id, endpoint=endpoint)
        self._authenticated = authenticated
        self._still_allowed = still_allowed
        self._owns = owns
        self._peers = PeerTable()
        self._relay = RelayTable()
        self._peer_names: tuple[str, ...] = ()
        self.connected.set()

    def peer_names(self) -> tuple[str, ...]:
        """FQCNs registered with this server (a snapshot safe to read from any thread)."""
        return self._peer_names

    def on_send_failed(self, send: Send, reason: str, peer_gone: bool, now_s: float) -> list[Action]:
        """As the base class; a connection that is gone also unregisters its cell."""
        actions: list[Action] = []
        if peer_gone and send.routing_id is not None:
            fqcn = self._peers.fqcn_of(send.routing_id)
            if fqcn is not None:
                actions += self._forget_peer(fqcn, f"{self.fqcn}: connection to {fqcn} is gone")
        return actions + super().on_send_failed(send, reason, peer_gone, now_s)

    def close(self) -> list[Action]:
        """Send BYE to every registered cell; fail this cell's requests with status closed."""
        actions: list[Action] = []
        for name in self._peers.names():
            peer = self._peers.get(name)
            assert peer is not None
            bye = Envelope(Kind.BYE, self._next_id(), self.fqcn, name)
            actions.append(Send(peer.routing_id, [encode_envelope(bye)], bye))
        self.connected.clear()
        self._fail_all()
        return actions

    # ----------------------------------------------------------------- role hooks

    def _received(
        self, routing_id: bytes | None, envelope: Envelope, frames: Sequence[Any], now_s: float, identity: str | None
    ) -> list[Action]:
        assert routing_id is not None
        if self._authenticated and not (identity and self._owns(identity, envelope.source)):
            return self._refuse_impostor(routing_id, envelope, identity)
        if identity and self._still_allowed is not None and not self._still_allowed(identity):
            return self._refuse_revoked(routing_id, envelope, identity)
        if envelope.kind is Kind.HELLO:
            return self._on_hello(routing_id, envelope, now_s, identity)
        fqcn = self._peers.fqcn_of(routing_id)
        if fqcn is None or envelope.source != fqcn:
            return self._refuse_connection(routing_id, envelope, fqcn)
        self._peers.touch(fqcn, now_s)
        if envelope.kind is Kind.BYE:
            return self._forget_peer(fqcn, f"{self.fqcn}: {fqcn} stopped")
        if envelope.kind is Kind.HELLO_ACK:
            self.count("unexpected_kind")
            return []
        too_large = self._size_problem(envelope, frames)
        if too_large:
            return self._refuse(envelope, too_large, now_s)
        if envelope.target == self.fqcn:
            return self._deliver(envelope, frames, now_s)
        return self._forward(envelope, frames, now_s)

    def _route_remote(self, envelope: Envelope, frames: Sequence[Any], now_s: float) -> list[Action]:
        peer = self._peers.get(envelope.target)
        if peer is None:
            return self._undeliverable(envelope, f"{self.fqcn}: no cell named {envelope.target!r} is connected", now_s)
        return [Send(peer.routing_id, frames, envelope)]

    def _sweep(self, now_s: float) -> list[Action]:
        timeout_s = self._settings.heartbeat_timeout_s
        actions: list[Action] = self._drop_revoked()
        gone = self._peers.expire(now_s, timeout_s)
        if gone:  # before failing requests, so whoever they wake sees the peer gone
            self._peer_names = tuple(self._peers.names())
        for peer in gone:
            self._relay.drop_source(peer.fqcn)
            actions += self._lost_peer(peer.fqcn, f"{self.fqcn}: no heartbeat from {peer.fqcn} for {timeout_s:g} s")
        self._relay.expire(now_s)
        return actions

    # ----------------------------------------------------------------- helpers

    def _drop_revoked(self) -> list[Action]:
        """Say BYE to every cell whose identity left the allowlist, and unregister it."""
        if self._still_allowed is None:
            return []
        actions: list[Action] = []
        for name in self._peers.names():
            peer = self._peers.get(name)
            assert peer is not None
            if peer.credential is None or self._still_allowed(peer.credential):
                continue
            self.count("revoked")
            why = f"{self.fqcn}: the key of {peer.credential!r} is no longer on the allowlist"
            bye = Envelope(Kind.BYE, self._next_id(), self.fqcn, name, reason=why)
            actions.append(Send(peer.routing_id, [encode_envelope(bye)], bye))
            actions += self._forget_peer(name, why)
        return actions

    def _refuse_connection(self, routing_id: bytes, envelope: Envelope, fqcn: str | None) -> list[Action]:
        """Answer a message from a connection that did not register, or lies about its name."""
        if fqcn is None:
            self.count("unregistered")
            why = f"{self.fqcn}: connection is not registered; send HELLO first"
        else:
            self.count("spoofed_source")
            why = f"{self.fqcn}: source {envelope.source!r} is not the name this connection registered ({fqcn!r})"
        REFUSALS.warning(logger, "message refused: %s kind=%s", why, envelope.kind.name)
        if envelope.kind is not Kind.REQUEST:
            return []
        answer = envelope.reply(self._next_id(), Status.ERROR, why)
        return [Send(routing_id, [encode_envelope(answer)], answer)]

    def _refuse_impostor(self, routing_id: bytes, envelope: Envelope, identity: str | None) -> list[Action]:
        """Answer a message whose source is not a name the connection's key owns."""
        self.count("impersonation")
        why = (
            f"{self.fqcn}: this connection is authenticated as {identity!r}, which may not send as {envelope.source!r}"
        )
        REFUSALS.warning(logger, "message refused: %s kind=%s", why, envelope.kind.name)
        if envelope.kind is Kind.HELLO:
            ack = Envelope(Kind.HELLO_ACK, self._next_id(), self.fqcn, envelope.source,
                           reply_to=envelope.msg_id, status=Status.ERROR, reason=why)  # fmt: skip
            return [Send(routing_id, [encode_envelope(ack)], ack)]
        if envelope.kind is not Kind.REQUEST:
            return []
        answer = envelope.reply(self._next_id(), Status.ERROR, why)
        return [Send(routing_id, [encode_envelope(answer)], answer)]

    def _refuse_revoked(self, routing_id: bytes, envelope: Envelope, identity: str) -> list[Action]:
        """Answer a message of a connection whose identity left the allowlist; forget its cell."""
        self.count("revoked")
        why = f"{self.fqcn}: the key of {identity!r} is no longer on the allowlist"
        REFUSALS.warning(logger, "message refused: %s kind=%s", why, envelope.kind.name)
        actions: list[Action] = []
        fqcn = self._peers.fqcn_of(routing_id)
        if fqcn is not None:
            actions += self._forget_peer(fqcn, why)
        if envelope.kind is Kind.HELLO:
            ack = Envelope(Kind.HELLO_ACK, self._next_id(), self.fqcn, envelope.source,
                           reply_to=envelope.msg_id, status=Status.ERROR, reason=why)  # fmt: skip
            return [*actions, Send(routing_id, [encode_envelope(ack)], ack)]
        if envelope.kind is Kind.REQUEST:
            answer = envelope.reply(self._next_id(), Status.ERROR, why)
            actions.append(Send(routing_id, [encode_envelope(answer)], answer))
        return actions

    def _on_hello(self, routing_id: bytes, envelope: Envelope, now_s: float, identity: str | None) -> list[Action]:
        name = envelope.source
        if (
            identity is not None
            and name not in self._peers
            and self._peers.count_of(identity) >= MAX_CELLS_PER_IDENTITY
        ):
            self.count("refused_hellos")
            why = f"{self.fqcn}: {identity} has {MAX_CELLS_PER_IDENTITY} cells registered already; {name!r} refused"
            ack = Envelope(Kind.HELLO_ACK, self._next_id(), self.fqcn, name,
                           reply_to=envelope.msg_id, status=Status.ERROR, reason=why)  # fmt: skip
            return [Send(routing_id, [encode_envelope(ack)], ack)]
        outcome = Registration.REFUSED if name == self.fqcn else self._peers.register(name, routing_id, now_s, identity)
        actions: list[Action] = []
        status, reason = Status.OK, ""
        if outcome is Registration.REFUSED:
            self.count("refused_hellos")
            status, reason = Status.ERROR, f"{self.fqcn}: the name {name!r} is taken"
        elif outcome is Registration.MOVED:
            logger.info("cell reconnected: fqcn=%s", name)
            actions += self._lost_peer(name, f"{self.fqcn}: {name} reconnected; messages in flight to it were lost")
        elif outcome is Registration.NEW:
            logger.info("cell registered: fqcn=%s peers=%d", name, len(self._peers))
        if outcome is Registration.NEW or outcome is Registration.MOVED:
            self._peer_names = tuple(self._peers.names())
        ack = Envelope(
            Kind.HELLO_ACK, self._next_id(), self.fqcn, name, reply_to=envelope.msg_id, status=status, reason=reason
        )
        actions.append(Send(routing_id, [encode_envelope(ack)], ack))
        return actions

    def _forward(self, envelope: Envelope, frames: Sequence[Any], now_s: float) -> list[Action]:
        """Pass a message between two other cells, unchanged (frames are not re-encoded)."""
        peer = self._peers.get(envelope.target)
        if peer is None:
            return self._undeliverable(envelope, f"{self.fqcn}: no cell named {envelope.target!r} is connected", now_s)
        if envelope.kind is Kind.REQUEST:
            remembered = self._relay.add(
                envelope.source,
                envelope.msg_id,
                envelope.target,
                envelope.channel,
                envelope.topic,
                now_s,
                envelope.timeout_ms / 1000,
            )
            if not remembered:
                self.count("relay_full")
                why = f"{self.fqcn}: too many requests of {envelope.source.split('.', 1)[0]} are waiting for replies"
                return self._refuse(envelope, why, now_s)
        elif envelope.kind is Kind.REPLY and envelope.reply_to is not None:
            self._relay.complete(envelope.target, envelope.reply_to, replier=envelope.source)
        return [Send(peer.routing_id, frames, envelope, relayed=True)]

    def forget_peer(self, fqcn: str, reason: str) -> list[Action]:
        """Unregister ``fqcn`` (and its child cells) at once: its process is known to have ended.

        Requests waiting for it fail UNREACHABLE with ``reason`` now, not after the heartbeat
        timeout. A new connection of the same name registers afresh.
        """
        actions: list[Action] = []
        for name in [n for n in self._peers.names() if n == fqcn or n.startswith(fqcn + ".")]:
            actions += self._forget_peer(name, reason)
        return actions

    def _forget_peer(self, fqcn: str, reason: str) -> list[Action]:
        if self._peers.remove(fqcn) is None:
            return []
        logger.info("cell unregistered: fqcn=%s reason=%s", fqcn, reason)
        self._peer_names = tuple(self._peers.names())
        self._relay.drop_source(fqcn)
        return self._lost_peer(fqcn, reason)

    def _lost_peer(self, fqcn: str, reason: str) -> list[Action]:
        """Fail this cell's requests to ``fqcn`` and answer those relayed to it."""
        failed = self._pending.fail_target(fqcn, Status.UNREACHABLE, reason)
        actions: list[Action] = []
        for relayed in self._relay.drop_target(fqcn):
            requester = self._peers.get(relayed.source)
            if requester is None:
                continue
            answer = Envelope(
                Kind.REPLY,
                self._next_id(),
                fqcn,
                relayed.source,
                relayed.channel,
                relayed.topic,
                reply_to=relayed.msg_id,
                status=Status.UNREACHABLE,
                reason=reason,
            )
            actions.append(Send(requester.routing_id, [encode_envelope(answer)], answer))
        if failed or actions:
            logger.warning(
                "peer lost: fqcn=%s failed_requests=%d relayed_answered=%d reason=%s",
                fqcn,
                failed,
                len(actions),
                reason,
            )
        return actions
