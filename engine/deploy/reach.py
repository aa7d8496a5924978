"""Whether anything listens at the server's address, asked before an admin session waits for it.

An admin session's cell keeps retrying a connection that is refused or never answered (that is
ZeroMQ's way), so a dead or unreachable server would show only as the session's whole connect
timeout running out. One plain TCP connection to the server's port, opened and closed at once,
tells those cases apart within `REACH_TIMEOUT_S`: nothing listens (refused), no route, or no
answer. It proves nothing about who listens; the session's CURVE handshake still decides that.
The server's ZeroMQ socket drops a connection that closes before its greeting without a trace.

This module imports nothing heavy, so the admin command can ask before it loads the rest.
"""

from __future__ import annotations

import errno
import socket

from engine.errors import CellUnreachableError

#: Seconds to wait for the server's port to accept a TCP connection before calling it unreachable
#: (a lost SYN is sent again after 1 s, so one loss still gets through).
REACH_TIMEOUT_S = 1.5


def check_reachable(host: str, port: int, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise when it refuses or does not answer in ``timeout_s``.

    Args:
        host: The server's host name or address, as the kit names it.
        port: The server's port.
        timeout_s: Seconds for the name lookup's addresses to accept (each), default `REACH_TIMEOUT_S`.

    Raises:
        CellUnreachableError: Nothing listens there, the host is unknown or unreachable, or it
            did not answer within ``timeout_s``; the message says which and what to check.
    """
    where = f"the server at tcp://{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except socket.gaierror as e:
        raise CellUnreachableError(
            f"{where}: unknown host {host!r} ({e.strerror}); check the server address of the kit"
        ) from e
    except TimeoutError as e:  # socket.timeout: SYNs unanswered, a firewall that drops them
        raise CellUnreachableError(
            f"{where} did not answer within {timeout_s:g} s (host down, or a firewall drops the connection)"
        ) from e
    except OSError as e:
        if e.errno == errno.ECONNREFUSED:
            raise CellUnreachableError(
                f"{where} is not running: nothing listens on port {port} of {host} (start it, or check the kit's "
                "server address)"
            ) from e
        raise CellUnreachableError(f"{where} cannot be reached: {e.strerror or e}") from e
