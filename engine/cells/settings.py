"""Settings of one cell, read from the ``cell { ... }`` object of a job or site config."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

_MAX_PORT = 65535
_MIN_MESSAGE_BYTES = 1024
_MAX_MESSAGE_BYTES = (1 << 63) - 1
_MAX_POOL = 1024
_MAX_IO_THREADS = 64
#: The most ZeroMQ I/O threads a server cell takes when ``io_threads`` is 0 (auto).
AUTO_SERVER_IO_THREADS_MAX = 4


@dataclasses.dataclass(frozen=True, slots=True)
class CellSettings:
    """Network, liveness and size settings of a cell.

    Attributes:
        host: Address a server cell binds to (default ``"127.0.0.1"``; ``"0.0.0.0"`` or
            ``"*"`` for all interfaces). Client cells take the server's endpoint from
            ``Cell(connect_to=...)``.
        port: TCP port a server cell binds to, 0..65535 (default 0: pick a free port; read the
            one chosen from ``Cell.endpoint``).
        heartbeat_interval_s: Seconds between heartbeats (client hello, ZMTP PING), > 0
            (default 2.0).
        heartbeat_timeout_s: Seconds of silence after which a peer counts as gone and its
            pending requests fail as unreachable (noticed within one sweep, at most
            ``min(heartbeat_interval_s / 2, 0.5)`` s, after that; a client sees a closed TCP
            connection at once); at least twice ``heartbeat_interval_s`` (default 10.0). It must
            also exceed the time one body frame takes on the wire, since liveness is only seen
            between whole frames; stream big data in chunks.
        max_message_size_bytes: Largest message (envelope plus all body frames) this cell sends
            or accepts, in bytes, 1024..2**63-1 (default 4 GiB). Enforced before sending, on
            receipt (error reply), and per frame by ZeroMQ (``MAXMSGSIZE``: the connection of a
            peer that sends a bigger frame is dropped).
        handler_pool_size: Threads that run handlers, 1..1024 (default 8). A handler that
            blocks holds one thread; the I/O thread never runs handlers.
        request_timeout_s: Default timeout of ``request`` and ``broadcast`` when the call
            gives none, > 0 (default 60.0).
        handlers_per_peer: Handlers one peer (a site with its child cells) may run at once,
            0..1024 (default 0: half of ``handler_pool_size``, at least 1). Its other messages
            wait for their turn without holding a thread.
        io_threads: ZeroMQ I/O threads of the cell, 0..64 (default 0: auto, one for a client
            cell, one per core up to 4 for a server). Each connection is served by one I/O
            thread, which also encrypts and decrypts its CURVE frames: with several, transfers
            to several clients at once use several cores.
    """

    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    max_message_size_bytes: int = 4 << 30
    handler_pool_size: int = 8
    request_timeout_s: float = 60.0
    handlers_per_peer: int = 0
    io_threads: int = 0

    def __post_init__(self) -> None:
        _check(isinstance(self.host, str) and self.host != "", "host", self.host, "a non-empty host name or address")
        _check(
            _is_int(self.port) and 0 <= self.port <= _MAX_PORT,
            "port",
            self.port,
            f"an integer in 0..{_MAX_PORT} (0 picks a free port)",
        )
        _check(
            _is_positive(self.heartbeat_interval_s),
            "heartbeat_interval_s",
            self.heartbeat_interval_s,
            "a number of seconds > 0",
        )
        _check(
            _is_positive(self.heartbeat_timeout_s) and self.heartbeat_timeout_s >= 2 * self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            self.heartbeat_timeout_s,
            f"a number of seconds >= 2 * heartbeat_interval_s ({self.heartbeat_interval_s})",
        )
        _check(
            _is_int(self.max_message_size_bytes)
            and _MIN_MESSAGE_BYTES <= self.max_message_size_bytes <= _MAX_MESSAGE_BYTES,
            "max_message_size_bytes",
            self.max_message_size_bytes,
            f"an integer in {_MIN_MESSAGE_BYTES}..2**63-1",
        )
        _check(
            _is_int(self.handler_pool_size) and 1 <= self.handler_pool_size <= _MAX_POOL,
            "handler_pool_size",
            self.handler_pool_size,
            f"an integer in 1..{_MAX_POOL}",
        )
        _check(
            _is_positive(self.request_timeout_s), "request_timeout_s", self.request_timeout_s, "a number of seconds > 0"
        )
        _check(
            _is_int(self.handlers_per_peer) and 0 <= self.handlers_per_peer <= _MAX_POOL,
            "handlers_per_peer",
            self.handlers_per_peer,
            f"an integer in 0..{_MAX_POOL} (0: half of handler_pool_size)",
        )
        _check(
            _is_int(self.io_threads) and 0 <= self.io_threads <= _MAX_IO_THREADS,
            "io_threads",
            self.io_threads,
            f"an integer in 0..{_MAX_IO_THREADS} (0: auto)",
        )

    def io_threads_for(self, server: bool) -> int:
        """The ZeroMQ I/O threads a cell of this role opens (``io_threads``, or the auto choice)."""
        if self.io_threads:
            return self.io_threads
        return max(1, min(AUTO_SERVER_IO_THREADS_MAX, os.cpu_count() or 1)) if server else 1

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CellSettings:
        """Build settings from a plain mapping such as a config's ``cell { ... }`` object.

        Missing keys take their defaults; the mapping is not modified.

        Args:
            config: Keys are the field names of this class.

        Returns:
            The settings.

        Raises:
            ValueError: On an unknown key (named, with the known ones) or a value out of bounds.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"cell.{unknown[0]}: unknown setting; known settings are {', '.join(sorted(known))}")
        return cls(**dict(config))


def _check(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"cell.{key}: expected {expected}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
