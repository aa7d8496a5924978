"""The thin ZeroMQ adapter: one thread that owns a cell's context and sockets.

It polls the data socket, the :class:`~engine.cells.outbox.Outbox` and (on a client) the
socket monitor, hands every event to :class:`~engine.cells.core.CellCore`, and carries out the
actions it returns. All protocol decisions live in the core; this module only knows ZeroMQ.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.cells.core import Action, CellCore, Dispatch, Send
from engine.cells.envelope import Envelope
from engine.cells.outbox import Outbox
from engine.cells.protocol import (
    CLOSE_LINGER_MAX_S,
    RECONNECT_INTERVAL_MAX_MS,
    RECONNECT_INTERVAL_MS,
    RECV_BATCH_MESSAGES,
)
from engine.cells.security import ZAP_ENDPOINT, CellSecurity, ZapHandler
from engine.cells.settings import CellSettings
from engine.errors import CellError

logger = logging.getLogger(__name__)

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
# Plain ints: pyzmq's flag enums cost an enum construction per ``|``, several per message.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


@dataclasses.dataclass(frozen=True, slots=True)
class StopCommand:
    """Outbox item that ends the loop; queued messages are flushed until ``deadline_s``."""

    deadline_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class ForgetPeerCommand:
    """Outbox item of a server cell: unregister the cell now named ``fqcn`` (its process ended)."""

    fqcn: str
    reason: str


class IoThread:
    """Runs the event loop of one cell on a dedicated daemon thread.

    Args:
        core: The protocol state machine.
        settings: The cell's settings (socket options).
        outbox: Where API and handler threads queue ``(envelope, frames)`` items.
        dispatch: Called on this thread with each :class:`Dispatch`; must not block.
        connect_to: Server endpoint for a client cell; None to bind (server cell).
        security: CURVE keys (and, for a server, the allowlist its ZAP handler applies); None
            for plain TCP.
    """

    def __init__(
        self,
        core: CellCore,
        settings: CellSettings,
        outbox: Outbox,
        dispatch: Callable[[Dispatch], None],
        connect_to: str | None,
        security: CellSecurity | None = None,
    ) -> None:
        self._core = core
        self._security = security
        self._zap: ZapHandler | None = None
        self._zap_socket: zmq.Socket[Any] | None = None
        self._settings = settings
        self._outbox = outbox
        self._dispatch = dispatch
        self._connect_to = connect_to
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{core.fqcn}-io", daemon=True)
        self._socket: zmq.Socket[Any] | None = None
        self.endpoint = connect_to or ""

    def start(self, timeout_s: float) -> str:
        """Start the thread, open the socket, and return the endpoint bound or dialled.

        Raises:
            CellError: If binding or connecting failed, or the thread did not start in time.
        """
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise CellError(f"cell {self._core.fqcn!r}: I/O thread did not start within {timeout_s:g} s")
        if self._startup_error is not None:
            raise CellError(
                f"cell {self._core.fqcn!r}: cannot open its socket: {self._startup_error}"
            ) from self._startup_error
        return self.endpoint

    def is_current_thread(self) -> bool:
        """True when called on this I/O thread (for instance from a future's callback)."""
        return threading.current_thread() is self._thread

    def stop(self, deadline_s: float) -> bool:
        """Ask the loop to say goodbye, close its sockets and end; wait until ``deadline_s``.

        Returns:
            True if the thread ended in time.
        """
        if not self._thread.is_alive():
            return True
        self._outbox.put(StopCommand(deadline_s))
        if self.is_current_thread():  # stopping from a callback: the loop ends after it returns
            return False
        self._thread.join(max(0.0, deadline_s - time.monotonic()))
        if self._thread.is_alive():
            logger.warning("I/O thread did not stop in time: cell=%s", self._core.fqcn)
            return False
        return True

    def send_now(self, envelope: Envelope, frames: Sequence[Any]) -> None:
        """Route a message at once, without the outbox (only on this I/O thread).

        An inline handler's reply goes out this way: queueing it would cost the loop another
        turn for a message that is ready.
        """
        assert self.is_current_thread(), "send_now is for the I/O thread"
        self._guarded(self._core.on_outgoing, envelope, frames, time.monotonic())

    # ----------------------------------------------------------------- thread body

    def _run(self) -> None:
        context = zmq.Context(io_threads=self._settings.io_threads_for(server=self._connect_to is None))
        monitor = None
        try:
            self._socket, monitor = self._open(context)
        except Exception as e:  # reported to start(); the thread ends here
            self._startup_error = e
            context.destroy(linger=0)
            self._ready.set()
            return
        self._ready.set()
        deadline_s = time.monotonic() + CLOSE_LINGER_MAX_S
        try:
            deadline_s = self._loop(self._socket, monitor)
        except Exception:  # every core call is guarded; this is the last line of defence
            logger.exception("I/O loop crashed: cell=%s", self._core.fqcn)
        finally:
            self._close(context, self._socket, monitor, deadline_s)

    def _open(self, context: zmq.Context[Any]) -> tuple[zmq.Socket[Any], zmq.Socket[Any] | None]:
        settings = self._settings
        server = self._connect_to is None
        sock = context.socket(zmq.ROUTER if server else zmq.DEALER)
        if self._security is not None:
            if server:  # the handler must be bound before the first client can connect
                assert self._security.allowlist is not None
                self._zap = ZapHandler(self._security.allowlist, self._core.fqcn)
                self._zap_socket = context.socket(zmq.REP)
                self._zap_socket.setsockopt(zmq.LINGER, 0)
                self._zap_socket.bind(ZAP_ENDPOINT)
            self._security.apply(sock)
        sock.setsockopt(zmq.LINGER, 0)  # raised for the final flush in _close
        sock.setsockopt(zmq.MAXMSGSIZE, settings.max_message_size_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(settings.heartbeat_interval_s))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(settings.heartbeat_timeout_s))
        # TTL travels in deciseconds on the wire; ZeroMQ caps it at 6553.5 s.
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(_ms(settings.heartbeat_timeout_s), 6_553_500))
        if server:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            port = settings.port or "*"
            sock.bind(f"tcp://{settings.host}:{port}")
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            return sock, None
        # Not IMMEDIATE: with it, ZeroMQ drops what was received but not yet read when a
        # connection ends, and the server's last reply before it stops would be lost. A request
        # while the link is down fails at once in the core instead (``connected`` is clear).
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_INTERVAL_MAX_MS)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)  # before connect: see the first one
        assert self._connect_to is not None
        sock.connect(self._connect_to)
        return sock, monitor

    def _loop(self, sock: zmq.Socket[Any], monitor: zmq.Socket[Any] | None) -> float:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._outbox.fileno(), zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        zap = self._zap_socket
        if zap is not None:
            poller.register(zap, zmq.POLLIN)
        outbox = self._outbox
        core = self._core
        due_s = 0.0
        while True:
            stop = self._drain_outbox()
            if stop is not None:
                return stop.deadline_s
            now_s = time.monotonic()
            if now_s >= due_s:
                self._guarded(core.on_tick, now_s)
            due_s = core.next_timer_s(now_s)
            wait_ms = 0
            if outbox.prepare_to_sleep():
                wait_ms = max(0, math.ceil((due_s - now_s) * 1000))
            ready = dict(poller.poll(wait_ms))
            outbox.woke()
            if sock in ready:
                self._receive(sock)
            if monitor is not None and monitor in ready:
                self._read_monitor(monitor)
            if zap is not None and zap in ready:
                self._answer_zap(zap)

    def _drain_outbox(self) -> StopCommand | None:
        stop = None
        for item in self._outbox.drain():
            if isinstance(item, StopCommand):
                stop = item
                continue
            if isinstance(item, ForgetPeerCommand):
                self._guarded(self._core.forget_peer, item.fqcn, item.reason)
                continue
            envelope, frames = item
            self._guarded(self._core.on_outgoing, envelope, frames, time.monotonic())
        return stop

    def _answer_zap(self, zap: zmq.Socket[Any]) -> None:
        """Answer the ZAP requests waiting (a REP socket: one request, one reply, in turn)."""
        assert self._zap is not None
        while zap.getsockopt(_EVENTS) & _POLLIN:
            try:
                request = zap.recv_multipart(_NOBLOCK)
                zap.send_multipart(self._zap.answer(request), _NOBLOCK)
            except Exception as e:  # never into the loop; ZeroMQ refuses a connection left unanswered
                logger.warning("ZAP request not answered: cell=%s error=%s", self._core.fqcn, e)
                return

    def _receive(self, sock: zmq.Socket[Any]) -> None:
        # Readiness is asked of the socket (a cheap getsockopt) instead of receiving until
        # zmq.Again: building that exception cost more than the rest of a small message.
        server = self._connect_to is None
        authenticated = server and self._security is not None
        recv = sock.recv
        for _ in range(RECV_BATCH_MESSAGES):
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                return
            frame = recv(_NOBLOCK, copy=False)
            frames = [frame]
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame)
            now_s = time.monotonic()
            if authenticated:
                # The identity ZAP gave this connection's key, stamped by ZeroMQ on each message.
                identity = _identity_of(frames[-1])
                self._guarded(self._core.on_frames, frames[0].bytes, frames[1:], now_s, identity)
            elif server:
                self._guarded(self._core.on_frames, frames[0].bytes, frames[1:], now_s)
            else:
                self._guarded(self._core.on_frames, None, frames, now_s)

    def _read_monitor(self, monitor: zmq.Socket[Any]) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            now_s = time.monotonic()
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._guarded(self._core.on_link_up, now_s)
            elif event["event"] & _HANDSHAKE_FAILED:
                self._guarded(self._core.on_handshake_failed, _handshake_failure(event), now_s)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                # What the server sent before it went away (its last replies, its BYE) is in the
                # socket already: take it before failing the requests still waiting.
                if self._socket is not None:
                    self._receive(self._socket)
                reason = (
                    f"{self._core.fqcn}: connection to the server at {self.endpoint} was "
                    "lost (server stopped or died, or it refused a frame above its "
                    "max_message_size_bytes)"
                )
                self._guarded(self._core.on_disconnected, reason, now_s)

    def _guarded(self, event: Callable[..., list[Action]], *args: Any) -> None:
        """Run a core event handler and its actions; nothing escapes into the loop."""
        try:
            self._perform(event(*args))
        except Exception:
            self._core.count("internal_errors")
            logger.exception("event failed: cell=%s event=%s", self._core.fqcn, event.__name__)

    def _perform(self, actions: Iterable[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._send(action)
            else:
                self._dispatch(action)

    def _send(self, action: Send) -> None:
        sock = self._socket
        assert sock is not None
        parts = action.frames if action.routing_id is None else [action.routing_id, *action.frames]
        try:
            # One part at a time with int flags (what send_multipart does, minus its checks):
            # ZeroMQ accepts the rest of a message once its first part is queued.
            send = sock.send
            last = len(parts) - 1
            for index, part in enumerate(parts):
                send(part, _NOBLOCK if index == last else _NOBLOCK_MORE, copy=False)
            return
        except zmq.Again:
            reason, gone = "no connection, or its send queue is full", False
        except zmq.ZMQError as e:
            gone = e.errno == zmq.EHOSTUNREACH
            reason = "the connection is gone" if gone else f"send failed: {e}"
        self._perform(self._core.on_send_failed(action, reason, gone, time.monotonic()))

    def _close(
        self,
        context: zmq.Context[Any],
        sock: zmq.Socket[Any] | None,
        monitor: zmq.Socket[Any] | None,
        deadline_s: float,
    ) -> None:
        if sock is not None:
            self._guarded(self._core.close)
        dropped = self._outbox.close()
        if dropped:
            logger.info("cell stopped with %d queued message(s) unsent: cell=%s", len(dropped), self._core.fqcn)
        linger_s = min(CLOSE_LINGER_MAX_S, max(0.0, deadline_s - time.monotonic()))
        if monitor is not None and sock is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        if self._zap_socket is not None:
            self._zap_socket.close(linger=0)
        if sock is not None:
            sock.close(linger=_ms(linger_s))
        context.term()
        logger.debug("cell sockets closed: cell=%s", self._core.fqcn)


def _identity_of(frame: Any) -> str | None:
    """The identity ZAP gave the connection a frame came on (None if ZeroMQ has none for it)."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None


def _handshake_failure(event: dict[str, Any]) -> str:
    """Say why a CURVE handshake with the server failed, from a monitor event."""
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the server refused this cell's key (ZAP status {event['value']}: not on its allowlist)"
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "the security handshake broke the protocol (the server does not use CURVE, or a frame was corrupted)"
    return (
        "the security handshake failed: the server's public key this cell was given does not match the "
        "server, or the server does not use CURVE"
    )


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))
