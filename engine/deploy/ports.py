"""Whether a server could bind a TCP port now: probed before a POC's ports are chosen and before a job port is used."""

from __future__ import annotations

import errno
import socket


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
