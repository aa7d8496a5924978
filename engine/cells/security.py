"""CURVE security of a cell: its keys, the server's allowlist, and the ZAP handler that applies it.

Every cell connection is a CurveZMQ connection (Curve25519 key exchange, encrypted and
authenticated frames) unless a cell is built without :class:`CellSecurity`, which only the
runtime's explicit ``insecure = true`` does. The server cell is a CURVE server; before ZeroMQ
lets a client's connection through, it asks the ZAP handler of the server's context, which
accepts only public keys on the allowlist and names the connection's *identity* (``site-1``,
``server``, an admin): ZeroMQ then stamps that identity on every message of the connection
(the ``User-Id`` property), and the server core lets a connection register only a name that the
identity owns (:func:`name_owned_by`).

The ZAP handler is a plain class (:class:`ZapHandler`): the I/O thread owns its socket and feeds
it the requests. Keys here are Z85 text (40 characters); files are the business of
:mod:`engine.security.keys`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import zmq
import zmq.utils.z85

from engine.cells.log_limit import REFUSALS

logger = logging.getLogger(__name__)

#: The ZAP domain every flengine server socket announces (ZeroMQ passes it to the handler).
ZAP_DOMAIN = b"flengine"
#: Where ZeroMQ sends ZAP requests; one handler per context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
_Z85_KEY_CHARS = 40
_RAW_KEY_BYTES = 32


def check_key(key: object, what: str) -> bytes:
    """Return ``key`` as 40 bytes of Z85 text, or raise ValueError naming ``what``."""
    if isinstance(key, str):
        key = key.encode("ascii", "replace")
    if not isinstance(key, bytes) or len(key) != _Z85_KEY_CHARS:
        # The value is never shown: it may be a secret key with a typo.
        size = f"{len(key)} characters" if isinstance(key, bytes) else f"a {type(key).__name__}"
        raise ValueError(f"{what}: expected a CURVE key of {_Z85_KEY_CHARS} Z85 characters, got {size}")
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(f"{what}: not a Z85-encoded CURVE key") from e
    return key


def name_owned_by(identity: str, fqcn: str) -> bool:
    """Whether a connection authenticated as ``identity`` may use the cell name ``fqcn``.

    An identity owns its own name and the names of its child cells: ``site-1`` may be
    ``site-1`` or ``site-1.job7``, never ``site-2`` or ``server``.
    """
    return fqcn == identity or fqcn.startswith(identity + ".")


class Allowlist:
    """The public keys a server cell accepts, each mapped to exactly one identity.

    Thread-safe: the I/O thread reads it for every handshake, and :meth:`replace` swaps the
    whole table at once: a reloaded allowlist applies to new connections, and a server cell
    refuses every further message of a connection whose identity left the list.

    Args:
        identities: Identity -> Z85 public key.

    Raises:
        ValueError: A key that is not a CURVE key, or one key given to two identities.

    Example:
        >>> import zmq
        >>> public, _ = zmq.curve_keypair()
        >>> Allowlist({"site-1": public}).identity_of_raw(zmq.utils.z85.decode(public))
        'site-1'
    """

    def __init__(self, identities: Mapping[str, bytes | str]) -> None:
        self._by_raw_key: dict[bytes, str] = {}
        self._identities: frozenset[str] = frozenset()
        self._delegated: dict[str, frozenset[str]] = {}  # identity -> the other site names it speaks for
        self._lock = threading.Lock()
        self.replace(identities)

    def replace(self, identities: Mapping[str, bytes | str]) -> None:
        """Swap in a new table (checked whole before anything changes)."""
        table: dict[bytes, str] = {}
        for identity, key in identities.items():
            if not isinstance(identity, str) or not identity:
                raise ValueError(f"allowlist: identity must be a non-empty string, got {identity!r}")
            raw = zmq.utils.z85.decode(check_key(key, f"allowlist[{identity!r}]"))
            if raw in table:
                raise ValueError(f"allowlist: {identity!r} and {table[raw]!r} have the same public key")
            table[raw] = identity
        with self._lock:
            self._by_raw_key = table
            self._identities = frozenset(table.values())

    def replace_with(self, other: Allowlist) -> None:
        """Swap in ``other``'s table (a freshly loaded allowlist file set) at once."""
        with other._lock:
            table = dict(other._by_raw_key)
        with self._lock:
            self._by_raw_key = table
            self._identities = frozenset(table.values())

    def keep_only(self, identities: Collection[str]) -> None:
        """Drop every identity not in ``identities`` (a job's server cell keeps only the job's sites)."""
        wanted = set(identities)
        with self._lock:
            self._by_raw_key = {raw: name for raw, name in self._by_raw_key.items() if name in wanted}
            self._identities = frozenset(self._by_raw_key.values())

    def delegate(self, table: Mapping[str, Collection[str]]) -> None:
        """Let each identity of ``table`` also use the site names it lists (replacing earlier delegations).

        A simulation's worker process holds one key and runs many virtual clients, one at a
        time, each as its own cell: ``{"worker-1": ["site-1", "site-5"]}`` lets the connections
        authenticated as ``worker-1`` register ``site-1``, ``site-5`` and their child cells, and
        nothing else. A name is delegated to one identity at most.

        Raises:
            ValueError: A name delegated to two identities, or an empty name.
        """
        owner: dict[str, str] = {}
        for identity, names in table.items():
            for name in names:
                if not isinstance(name, str) or not name or "." in name:
                    raise ValueError(f"delegation of {identity!r}: expected site names, got {name!r}")
                if owner.setdefault(name, identity) != identity:
                    raise ValueError(f"delegation: {name!r} is given to both {owner[name]!r} and {identity!r}")
        frozen = {identity: frozenset(names) for identity, names in table.items()}
        with self._lock:
            self._delegated = frozen

    def owns(self, identity: str, fqcn: str) -> bool:
        """Whether a connection authenticated as ``identity`` may use the cell name ``fqcn``.

        Its own names (`name_owned_by`) and those of the sites delegated to it (`delegate`).
        """
        if name_owned_by(identity, fqcn):
            return True
        delegated = self._delegated.get(identity)  # one read of an immutable mapping value
        return delegated is not None and fqcn.split(".", 1)[0] in delegated

    def identity_of_raw(self, raw_key: bytes) -> str | None:
        """The identity of a 32-byte public key, or None when the key is not on the list."""
        with self._lock:
            return self._by_raw_key.get(raw_key)

    def has_identity(self, identity: str) -> bool:
        """Whether ``identity`` is on the list now (a revoked one is not)."""
        return identity in self._identities  # one read of an immutable set: no lock needed

    def identities(self) -> list[str]:
        """The identities on the list, sorted."""
        with self._lock:
            return sorted(self._by_raw_key.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_raw_key)


@dataclasses.dataclass(frozen=True, slots=True)
class CellSecurity:
    """The CURVE settings of one cell.

    Attributes:
        public_key: This cell's public key (Z85).
        secret_key: This cell's secret key (Z85).
        server_public_key: A client cell: the public key of the server it connects to. A
            server cell: None.
        allowlist: A server cell: the client keys it accepts and their identities. A client:
            None.
    """

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes | None = None
    allowlist: Allowlist | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", check_key(self.public_key, "public_key"))
        object.__setattr__(self, "secret_key", check_key(self.secret_key, "secret_key"))
        if self.server_public_key is not None:
            object.__setattr__(self, "server_public_key", check_key(self.server_public_key, "server_public_key"))
        if (self.server_public_key is None) == (self.allowlist is None):
            raise ValueError("CellSecurity: give a server_public_key (client cell) or an allowlist (server cell)")

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (allowlist given) or CURVE client."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        if self.allowlist is not None:
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN
            # With no ZAP handler, ZeroMQ would let every key in; enforced, it refuses them all.
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        else:
            assert self.server_public_key is not None
            sock.curve_serverkey = self.server_public_key


class ZapHandler:
    """Answers ZAP requests (RFC 27) from a CURVE server socket: allowlisted keys only.

    Sans-I/O: :meth:`answer` takes the frames of one request and returns the reply frames.
    A refused key gets status 400 (ZeroMQ then closes that connection and tells the client
    ``HANDSHAKE_FAILED_AUTH``); any other mechanism, or a malformed request, too.

    Args:
        allowlist: The keys accepted.
        server_name: The server cell's name, for logs.
    """

    def __init__(self, allowlist: Allowlist, server_name: str) -> None:
        self._allowlist = allowlist
        self._server_name = server_name
        self.refused = 0

    def answer(self, frames: Sequence[bytes]) -> list[bytes]:
        """Return the reply to one ZAP request."""
        if len(frames) < 6:
            self.refused += 1
            REFUSALS.warning(
                logger, "malformed ZAP request refused: server=%s frames=%d", self._server_name, len(frames)
            )
            request_id = frames[1] if len(frames) > 1 else b""
            return [ZAP_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _routing_id, mechanism, *credentials = frames
        identity = None
        if version == ZAP_VERSION and domain == ZAP_DOMAIN and mechanism == b"CURVE" and len(credentials) == 1:
            if len(credentials[0]) == _RAW_KEY_BYTES:
                identity = self._allowlist.identity_of_raw(bytes(credentials[0]))
        if identity is None:
            self.refused += 1
            key = zmq.utils.z85.encode(credentials[0]).decode() if _is_raw_key(credentials) else "?"
            REFUSALS.warning(
                logger,
                "connection refused: server=%s address=%s mechanism=%s key=%s reason=key not on the allowlist",
                self._server_name,
                address.decode("utf-8", "replace"),
                mechanism.decode("utf-8", "replace"),
                key,
            )
            return [ZAP_VERSION, request_id, b"400", b"key not on the allowlist", b"", b""]
        logger.debug("connection authenticated: server=%s identity=%s", self._server_name, identity)
        return [ZAP_VERSION, request_id, b"200", b"OK", identity.encode("utf-8"), b""]


def _is_raw_key(credentials: Sequence[bytes]) -> bool:
    return len(credentials) == 1 and len(credentials[0]) == _RAW_KEY_BYTES
