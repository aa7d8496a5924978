"""Job ports, and whether a server could bind a TCP port now (the daemon and POC probe before use)."""

from __future__ import annotations

import collections
import errno
import logging
import socket
from collections.abc import Iterable

log = logging.getLogger(__name__)


def port_taken(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` is in use, probed as a ZeroMQ bind (``SO_REUSEADDR``).

    A port held only by closed connections (TIME_WAIT) is free, as it is to ZeroMQ.

    Raises:
        OSError: The probe failed for another reason (an address this host does not have, say).
    """
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


class JobPorts:
    """The server daemon's job ports: which are free, and which of those another program holds.

    Not thread-safe: the daemon calls it under its own lock.

    Args:
        ports: The job ports, in the order they are handed out.
        host: The address job processes bind (probed before a port is handed out).
    """

    def __init__(self, ports: Iterable[int], host: str) -> None:
        self.host = host
        self._free = collections.deque(ports)
        self._passed_over: set[int] = set()  # free ports another program held when last looked at

    def __bool__(self) -> bool:
        """Whether any port is free (no job holds it; another program may)."""
        return bool(self._free)

    def take(self, preferred: int | None = None) -> int | None:
        """A free port that no other program holds now, ``preferred`` first; None if there is none.

        A port another program listens on is passed over (the job's process would fail to bind
        it), logged once, and kept for later.
        """
        ports = list(self._free)
        if preferred in ports:
            ports.remove(preferred)
            ports.insert(0, preferred)
        for port in ports:
            try:
                taken = port_taken(self.host, port)
            except OSError:
                taken = False  # not this probe's to judge: the job's process reports what its bind meets
            if not taken:
                self._passed_over.discard(port)
                self._free.remove(port)
                return port
            if port not in self._passed_over:  # said once, not at every look of the scheduler
                self._passed_over.add(port)
                log.warning("job port %d is in use by another program; passed over until it is free", port)
        return None

    def give_back(self, port: int) -> None:
        """``port`` is free again, last in the line: a late client of its job finds nobody there."""
        self._free.append(port)

    def held_elsewhere(self) -> str:
        """Why no port could be taken: the free ones, held by other programs."""
        return f"{', '.join(map(str, self._free))} on {self.host} are in use by other programs"
