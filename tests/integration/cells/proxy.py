"""A TCP proxy on 127.0.0.1 between a client cell and its server, that a test cuts on purpose.

`drop()` resets every connection through it (the client sees its connection close and dials
again); `cut()` stops moving bytes and takes no new connection (a link that went silent: what
was sent waits in the kernel's buffers); `restore()` moves them again. Every wait is bounded and
`close()` ends every socket and thread it opened.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading


class CutProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (``tcp://host:port``) until the test cuts it."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cut-proxy", daemon=True)
        self._thread.start()

    def drop(self) -> None:
        """Reset every connection now (RST): both ends see it closed at once."""
        with self._lock:
            sockets = list(self._pairs)
            self._pairs.clear()
        for sock in sockets:
            _reset(sock)

    def cut(self) -> None:
        """Stop moving bytes and accepting connections: the link is silent until `restore`."""
        self._flowing.clear()

    def restore(self) -> None:
        """Move bytes again (what waited in the buffers goes through)."""
        self._flowing.set()

    def close(self) -> None:
        """End the proxy: every connection and the listener closed, the thread joined."""
        self._closed.set()
        self._flowing.set()
        self._thread.join(5.0)
        self.drop()
        self._listener.close()

    def __enter__(self) -> CutProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        registered: set[socket.socket] = set()
        try:
            while not self._closed.is_set():
                if not self._flowing.wait(0.05):
                    continue
                with self._lock:
                    live = set(self._pairs)
                for sock in registered - live:
                    selector.unregister(sock)
                for sock in live - registered:
                    selector.register(sock, selectors.EVENT_READ)
                registered = live
                for key, _ in selector.select(0.05):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif self._flowing.is_set():
                        self._pump(key.fileobj)  # type: ignore[arg-type]
        finally:
            selector.close()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self._upstream, timeout=5.0)
        except OSError:
            _reset(client)
            return
        for sock in (client, upstream):
            sock.setblocking(True)
            sock.settimeout(5.0)
        with self._lock:
            self._pairs[client], self._pairs[upstream] = upstream, client

    def _pump(self, sock: socket.socket) -> None:
        with self._lock:
            other = self._pairs.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(1 << 20)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        with self._lock:  # one side closed: close the other
            self._pairs.pop(sock, None)
            self._pairs.pop(other, None)
        _reset(sock)
        _reset(other)


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (linger 0), not a graceful FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
