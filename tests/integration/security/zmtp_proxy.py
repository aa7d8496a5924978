"""A TCP man in the middle for ZeroMQ connections: forwards both ways, and on request replays,
tampers with or truncates one encrypted frame that a client sends (ZMTP 3 framing)."""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass, field

GREETING_BYTES = 64
_LONG, _COMMAND = 0x02, 0x04
CURVE_MESSAGE = b"\x07MESSAGE"


@dataclass
class _Frame:
    flags: int
    body: bytes

    def encode(self) -> bytes:
        if len(self.body) > 255 or self.flags & _LONG:
            return bytes([self.flags | _LONG]) + struct.pack(">Q", len(self.body)) + self.body
        return bytes([self.flags]) + bytes([len(self.body)]) + self.body


@dataclass
class ZmtpProxy:
    """Listens on 127.0.0.1 and forwards every connection to ``target_port``.

    ``attack`` is one of None, ``"replay"`` (send the client's last encrypted frame again),
    ``"tamper"`` (flip one byte of the next one) or ``"truncate"`` (cut its last byte); it
    applies once, to the first client frame that carries a CURVE MESSAGE after ``arm()``.
    """

    target_port: int
    attack: str | None = None
    port: int = 0
    attacked: threading.Event = field(default_factory=threading.Event)
    #: Set when the server closes a connection after the attack (what a forged frame must cause).
    dropped_by_server: threading.Event = field(default_factory=threading.Event)
    _armed: bool = False
    _listener: socket.socket | None = None
    _sockets: list[socket.socket] = field(default_factory=list)

    def start(self) -> ZmtpProxy:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def arm(self) -> None:
        self._armed = True

    def close(self) -> None:
        for sock in [self._listener, *self._sockets]:
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, server]
            threading.Thread(target=self._server_to_client, args=(server, client), daemon=True).start()
            threading.Thread(target=self._client_to_server, args=(client, server), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _server_to_client(self, server: socket.socket, client: socket.socket) -> None:
        self._pipe(server, client)
        if self.attacked.is_set():
            self.dropped_by_server.set()

    def _client_to_server(self, client: socket.socket, server: socket.socket) -> None:
        reader = _Reader(client)
        try:
            sent = 0  # the greeting goes in parts, each side waiting for the other's first part
            while sent < GREETING_BYTES:
                part = reader.some(GREETING_BYTES - sent)
                server.sendall(part)
                sent += len(part)
            last_message: bytes | None = None
            while True:
                frame = reader.frame()
                if frame is None:
                    break
                wire = frame.encode()
                if self._armed and frame.body.startswith(CURVE_MESSAGE) and not self.attacked.is_set():
                    wire = self._attack(frame, wire, last_message)
                if frame.body.startswith(CURVE_MESSAGE):
                    last_message = frame.encode()
                server.sendall(wire)
        except OSError:
            pass
        self._pipe(client, server)

    def _attack(self, frame: _Frame, wire: bytes, last_message: bytes | None) -> bytes:
        if self.attack == "replay" and last_message is not None:
            self.attacked.set()
            return wire + last_message  # the genuine frame, then an earlier one again
        if self.attack == "tamper":
            self.attacked.set()
            body = bytearray(frame.body)
            body[-1] ^= 0xFF
            return _Frame(frame.flags, bytes(body)).encode()
        if self.attack == "truncate":
            self.attacked.set()
            return _Frame(frame.flags, frame.body[:-1]).encode()
        return wire


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def some(self, most: int) -> bytes:
        if not self._buffer:
            data = self._sock.recv(1 << 16)
            if not data:
                raise OSError("closed")
            self._buffer = data
        out, self._buffer = self._buffer[:most], self._buffer[most:]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            data = self._sock.recv(1 << 16)
            if not data:
                raise OSError("closed")
            self._buffer += data
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def frame(self) -> _Frame | None:
        try:
            flags = self.exactly(1)[0]
            size = struct.unpack(">Q", self.exactly(8))[0] if flags & _LONG else self.exactly(1)[0]
            return _Frame(flags, self.exactly(size))
        except OSError:
            return None
