"""The server's table of connected cells: FQCN -> how to reach it.

A ZeroMQ routing id names a connection, not a cell: it changes on every reconnect and anyone
can open a connection. The table therefore binds an FQCN to the connection that registered it
(with a HELLO), checks every later message against that binding, and records the connection's
``credential``: the identity its CURVE key authenticated (a secure server). Once a cell
registered with a credential, only that credential may claim its name.
"""

from __future__ import annotations

import dataclasses
import enum
import logging

from engine.cells.log_limit import REFUSALS

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Peer:
    """One registered cell.

    Attributes:
        fqcn: The cell's name.
        routing_id: ZeroMQ routing id of its current connection.
        last_seen_s: Monotonic time of the last message from it.
        credential: Identity the connection's CURVE key authenticated, or None while
            security is off.
    """

    fqcn: str
    routing_id: bytes
    last_seen_s: float
    credential: str | None = None


class Registration(enum.Enum):
    """Outcome of :meth:`PeerTable.register`."""

    NEW = "new"
    """The name was not registered."""
    REFRESHED = "refreshed"
    """Same name, same connection: a heartbeat."""
    MOVED = "moved"
    """Same name on a new connection (a reconnect): messages in flight on the old one are lost."""
    REFUSED = "refused"
    """The name is bound to another credential, or the connection already has another name."""


class PeerTable:
    """FQCN <-> routing id bindings with last-seen times; owned by one thread (the I/O thread).

    Example:
        >>> table = PeerTable()
        >>> table.register("site-1", b"\\x00ab", now_s=10.0)
        <Registration.NEW: 'new'>
        >>> table.fqcn_of(b"\\x00ab")
        'site-1'
    """

    def __init__(self) -> None:
        self._by_fqcn: dict[str, Peer] = {}
        self._by_routing_id: dict[bytes, str] = {}

    def __len__(self) -> int:
        return len(self._by_fqcn)

    def __contains__(self, fqcn: object) -> bool:
        return fqcn in self._by_fqcn

    def names(self) -> list[str]:
        """Return the registered FQCNs, sorted."""
        return sorted(self._by_fqcn)

    def get(self, fqcn: str) -> Peer | None:
        """Return the peer registered under ``fqcn``, or None."""
        return self._by_fqcn.get(fqcn)

    def count_of(self, credential: str) -> int:
        """How many registered cells authenticated as ``credential``."""
        return sum(1 for peer in self._by_fqcn.values() if peer.credential == credential)

    def fqcn_of(self, routing_id: bytes) -> str | None:
        """Return the FQCN registered on a connection, or None if it never said hello."""
        return self._by_routing_id.get(routing_id)

    def register(
        self,
        fqcn: str,
        routing_id: bytes,
        now_s: float,
        credential: str | None = None,
    ) -> Registration:
        """Bind ``fqcn`` to a connection, or refresh the binding.

        Args:
            fqcn: Name the connection claims.
            routing_id: The connection.
            now_s: Monotonic time of the HELLO.
            credential: Identity the connection authenticated as, if security is on.

        Returns:
            What happened; on ``MOVED`` the caller fails what was in flight to the old
            connection.
        """
        owner = self._by_routing_id.get(routing_id)
        if owner is not None and owner != fqcn:
            REFUSALS.warning(logger, "peer refused: fqcn=%s connection already registered as %s", fqcn, owner)
            return Registration.REFUSED
        peer = self._by_fqcn.get(fqcn)
        if peer is None:
            self._by_fqcn[fqcn] = Peer(fqcn, routing_id, now_s, credential)
            self._by_routing_id[routing_id] = fqcn
            return Registration.NEW
        if peer.credential is not None and peer.credential != credential:
            REFUSALS.warning(logger, "peer refused: fqcn=%s claimed with a different credential", fqcn)
            return Registration.REFUSED
        peer.last_seen_s = now_s
        if peer.routing_id == routing_id:
            return Registration.REFRESHED
        del self._by_routing_id[peer.routing_id]
        peer.routing_id = routing_id
        peer.credential = credential
        self._by_routing_id[routing_id] = fqcn
        return Registration.MOVED

    def touch(self, fqcn: str, now_s: float) -> None:
        """Record traffic from a registered peer."""
        peer = self._by_fqcn.get(fqcn)
        if peer is not None:
            peer.last_seen_s = now_s

    def remove(self, fqcn: str) -> Peer | None:
        """Forget a peer; return it, or None if it was not registered."""
        peer = self._by_fqcn.pop(fqcn, None)
        if peer is not None:
            self._by_routing_id.pop(peer.routing_id, None)
        return peer

    def expire(self, now_s: float, timeout_s: float) -> list[Peer]:
        """Remove and return the peers silent for more than ``timeout_s`` seconds."""
        gone = [p for p in self._by_fqcn.values() if now_s - p.last_seen_s > timeout_s]
        for peer in gone:
            self.remove(peer.fqcn)
        return gone
