"""The public :class:`Cell`: one named endpoint of the messaging layer.

A cell started without ``connect_to`` is the server: it binds a TCP endpoint and routes
between the cells connected to it. A cell started with ``connect_to`` is a client: it dials the
server and registers its FQCN there. Any cell can reach any other by name; messages between two
clients pass through the server.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from engine.cells.client_core import ClientCore
from engine.cells.core import Dispatch
from engine.cells.dispatch import InlineHandler, always_inline, run_handler
from engine.cells.envelope import Envelope, encode_envelope
from engine.cells.fqcn import check_fqcn
from engine.cells.framing import frame_message, new_envelope
from engine.cells.handlers import Handler, HandlerRegistry
from engine.cells.io_thread import ForgetPeerCommand, IoThread
from engine.cells.log_limit import REFUSALS
from engine.cells.message import Message
from engine.cells.outbox import Outbox
from engine.cells.pending import PendingRequests, ReplyFuture
from engine.cells.pool import HandlerPool
from engine.cells.protocol import HANDLER_GRACE_MAX_S, SETTLE_GRACE_S, STOP_POLL_S, Kind, Status
from engine.cells.security import Allowlist, CellSecurity, name_owned_by
from engine.cells.server_core import ServerCore
from engine.cells.settings import CellSettings
from engine.errors import CellClosedError, CellError

logger = logging.getLogger(__name__)

_NEW, _RUNNING, _STOPPED = "new", "running", "stopped"


class Cell:
    """A named messaging endpoint over ZeroMQ.

    Args:
        fqcn: The cell's name, e.g. ``"server"``, ``"site-1"`` or ``"site-1.job1"``.
        settings: Network, liveness and size settings (defaults if None).
        connect_to: Endpoint of the server cell (``"tcp://host:port"``) for a client cell;
            None makes this cell the server, bound on ``settings.host:settings.port``.
        security: CURVE keys: a server cell's own key pair and allowlist, a client cell's own
            key pair and the server's public key. None: plain TCP, for tests of this layer and
            the runtime's explicit ``insecure = true`` only; every connection of a secure server
            must then authenticate, and may send only as a name its key owns.

    Example:
        >>> from engine.cells import Cell, Reply
        >>> with Cell("server") as server, Cell("site-1", connect_to=server.endpoint) as site:
        ...     site.register_handler("demo", "echo", lambda m: Reply(frames=m.frames))
        ...     _ = site.wait_connected(5.0)
        ...     bytes(server.request("site-1", "demo", "echo", frames=[b"hi"]).frames[0])
        b'hi'
    """

    def __init__(
        self,
        fqcn: str,
        settings: CellSettings | None = None,
        connect_to: str | None = None,
        security: CellSecurity | None = None,
    ) -> None:
        self._fqcn = check_fqcn(fqcn)
        if connect_to is not None and not (isinstance(connect_to, str) and connect_to.startswith("tcp://")):
            raise ValueError(f"connect_to: expected 'tcp://host:port', got {connect_to!r}")
        self._settings = settings if settings is not None else CellSettings()
        self._ids = itertools.count(random.getrandbits(48) + 1)
        self._handlers = HandlerRegistry()
        self._pending = PendingRequests(self._fqcn)
        if security is not None and (security.allowlist is None) != (connect_to is not None):
            raise ValueError(
                f"cell {fqcn!r}: a server cell's security needs an allowlist, a client cell's the server's public key"
            )
        allowlist = None if security is None else security.allowlist
        if connect_to is None:
            self._core: ServerCore | ClientCore = ServerCore(
                self._fqcn,
                self._settings,
                handlers=self._handlers,
                pending=self._pending,
                next_id=self._next_id,
                authenticated=security is not None,
                still_allowed=None if allowlist is None else allowlist.has_identity,
                owns=name_owned_by if allowlist is None else allowlist.owns,
            )
        else:
            self._core = ClientCore(
                self._fqcn,
                self._settings,
                handlers=self._handlers,
                pending=self._pending,
                next_id=self._next_id,
                endpoint=connect_to,
            )
        self._security = security
        self._outbox = Outbox()
        self._pool = HandlerPool(
            self._settings.handler_pool_size,
            self._fqcn,
            self._settings.handlers_per_peer or None,
            on_result=self._outbox.put,  # a handler's reply, queued as its worker's last act
        )
        self._io = IoThread(self._core, self._settings, self._outbox, self._dispatch, connect_to, security)
        self._state = _NEW
        self._state_lock = threading.Lock()

    # ----------------------------------------------------------------- properties

    @property
    def fqcn(self) -> str:
        """The cell's fully qualified name."""
        return self._fqcn

    @property
    def settings(self) -> CellSettings:
        """The cell's settings."""
        return self._settings

    @property
    def is_server(self) -> bool:
        """True for the cell that binds and routes."""
        return self._core.is_server

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` bound (server, with the real port once started) or dialled."""
        return self._io.endpoint

    @property
    def secure(self) -> bool:
        """True when the cell's connections use CURVE."""
        return self._security is not None

    @property
    def allowlist(self) -> Allowlist | None:
        """Server: the keys it accepts (replace them to reload; revoked identities are cut off)."""
        return None if self._security is None else self._security.allowlist

    @property
    def link_error(self) -> str | None:
        """Client: why the server last refused this cell (security handshake or registration).

        None while nothing was refused, and again once a connection is let in. A client that
        is not connected after :meth:`wait_connected` reads it to tell a refusal (wrong keys)
        from a server that is not there yet.
        """
        return self._core.link_error

    @property
    def connected(self) -> bool:
        """Client: registered with the server and hearing from it. Server: True while running."""
        return self._core.link_up

    def peers(self) -> tuple[str, ...]:
        """FQCNs currently registered with this server cell (empty on a client)."""
        return self._core.peer_names()

    def stats(self) -> dict[str, int]:
        """Counters of what the cell refused or dropped: malformed, no_handler, ..."""
        return self._core.stats()

    # ----------------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 10.0) -> Cell:
        """Open the socket and start the I/O thread and handler pool.

        A client returns before it is registered; call :meth:`wait_connected` to wait.

        Args:
            timeout_s: Longest wait for the socket to open, in seconds (default 10).

        Returns:
            This cell.

        Raises:
            CellError: If the cell was already started, or binding/connecting failed.
        """
        with self._state_lock:
            if self._state != _NEW:
                raise CellError(f"cell {self._fqcn!r} was already started; make a new Cell")
            self._state = _RUNNING
        self._pool.start()
        try:
            self._io.start(timeout_s)
        except Exception:
            self._state = _STOPPED
            self._pool.stop(time.monotonic())
            raise
        logger.info(
            "cell started: fqcn=%s role=%s endpoint=%s security=%s",
            self._fqcn,
            "server" if self.is_server else "client",
            self.endpoint,
            "curve" if self._security is not None else "none",
        )
        return self

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until a client cell is registered with its server.

        Args:
            timeout_s: Longest wait, in seconds.

        Returns:
            True once registered (always True on a server), False on timeout.
        """
        return self._core.connected.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Let running handlers reply, say goodbye to peers, fail outstanding requests, close sockets.

        Messages that arrive from now on are dropped (their senders hear BYE). Handlers already
        running get up to ``HANDLER_GRACE_MAX_S`` (at most half of ``timeout_s``) to finish, and
        their replies are sent before the sockets close: a reply computed just before stop is not
        lost. Then requests still waiting fail with :class:`CellClosedError`. Handlers still
        running after the grace are left to finish on their daemon threads; their replies are
        dropped. Calling stop twice is harmless.

        Args:
            timeout_s: Bound on the whole shutdown, in seconds (default 5).
        """
        with self._state_lock:
            was_running = self._state == _RUNNING
            self._state = _STOPPED
        if not was_running:
            return
        now_s = time.monotonic()
        deadline_s = now_s + timeout_s
        self._pool.stop(now_s + min(HANDLER_GRACE_MAX_S, timeout_s / 2))
        self._io.stop(deadline_s)
        logger.info("cell stopped: fqcn=%s", self._fqcn)

    def __enter__(self) -> Cell:
        return self.start() if self._state == _NEW else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------- handlers

    def register_handler(
        self, channel: str, topic: str, handler: Handler, inline: bool | Callable[[Message], bool] = False
    ) -> None:
        """Run ``handler`` for messages on ``(channel, topic)``; topic ``"*"`` catches the rest.

        Handlers run on the cell's handler pool and may block (each holds one of
        ``handler_pool_size`` threads while it runs). One peer (a site and its child cells)
        runs at most ``handlers_per_peer`` handlers at once; its further messages wait their
        turn without holding a thread, so a peer that floods the cell with slow requests cannot
        starve the others.

        Args:
            channel: Handler channel.
            topic: Handler topic, or ``"*"``.
            handler: Called with each message.
            inline: Run the handler on the I/O thread itself, saving two thread hand-offs per
                request. Only for handlers that never block and return quickly (serving a chunk
                from memory): while one runs, the cell moves no other message. A predicate
                decides per message instead: called on the I/O thread (it must be quick), True
                runs the handler there, False on the pool.

        Raises:
            ValueError: If the pair already has a handler, or a name is empty.
        """
        if callable(inline):
            handler = InlineHandler(handler, inline)
        elif inline:
            handler = InlineHandler(handler, always_inline)
        self._handlers.register(channel, topic, handler)

    def unregister_handler(self, channel: str, topic: str) -> None:
        """Remove the handler of ``(channel, topic)``."""
        self._handlers.unregister(channel, topic)

    # ----------------------------------------------------------------- messaging

    def request(
        self,
        target: str,
        channel: str,
        topic: str,
        header: Mapping[str, Any] | None = None,
        frames: Sequence[Any] = (),
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> Message:
        """Send a request and wait for its reply.

        Args:
            target: FQCN of the cell to ask.
            channel: Handler channel on the target.
            topic: Handler topic on the target.
            header: Small msgpack-serializable dict for the handler.
            frames: Body frames (buffer-protocol objects), sent zero-copy: do not modify them
                until this call returns.
            timeout_s: Longest wait in seconds (default ``settings.request_timeout_s``).
            stop: Set to give up the wait at once (looked at every `STOP_POLL_S`); the request
                then fails as if this cell had stopped (`CellClosedError`), and a reply that
                comes later is dropped.

        Returns:
            The reply, status ok; its frames are zero-copy views.

        Raises:
            CellTimeoutError: No reply in time.
            CellUnreachableError: The target is not connected or vanished meanwhile.
            CellRemoteError: The target answered with an error (its handler raised, ...).
            CellMessageTooLargeError: The message exceeds ``max_message_size_bytes``.
            CellClosedError: This cell is not running or stopped meanwhile.
        """
        timeout_s = self._timeout(timeout_s)
        if self._io.is_current_thread():
            raise CellError(
                f"request to {target!r} (channel={channel!r}, topic={topic!r}) called on the I/O thread "
                f"of cell {self._fqcn!r} (from a future callback?) would block it; use request_async"
            )
        future = self.request_async(target, channel, topic, header, frames, timeout_s)
        try:
            reply = future.result(timeout=timeout_s) if stop is None else self._result_unless(future, timeout_s, stop)
        except concurrent.futures.TimeoutError:
            # After fail() the future is done (failed now), or about to be: the I/O thread took
            # its reply from the table a moment ago and is setting it.
            self._pending.fail(future.msg_id, Status.TIMEOUT, f"{self._fqcn}: no reply within {timeout_s:g} s")
            reply = future.result(timeout=SETTLE_GRACE_S)
        return reply.raise_for_status()

    def _result_unless(self, future: ReplyFuture, timeout_s: float, stop: threading.Event) -> Message:
        """``future.result(timeout_s)``, failed as closed as soon as ``stop`` is set."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_s = deadline - time.monotonic()
            try:
                return future.result(timeout=max(0.0, min(left_s, STOP_POLL_S)))
            except concurrent.futures.TimeoutError:
                if left_s <= STOP_POLL_S:
                    raise
                if stop.is_set():
                    self._pending.fail(future.msg_id, Status.CLOSED, f"{self._fqcn}: the wait for it was stopped")
                    return future.result(timeout=SETTLE_GRACE_S)

    def request_async(
        self,
        target: str,
        channel: str,
        topic: str,
        header: Mapping[str, Any] | None = None,
        frames: Sequence[Any] = (),
        timeout_s: float | None = None,
    ) -> ReplyFuture:
        """Send a request and return a future of its reply, to keep several in flight.

        The future always resolves with a :class:`Message`, whatever its status (a timeout
        is enforced by the cell); call :meth:`Message.raise_for_status` to turn a failure into
        an exception. Callbacks added to the future run on the I/O thread: keep them short.

        Args and raises: as :meth:`request`, except delivery failures, which resolve the
            future instead.
        """
        timeout_s = self._timeout(timeout_s)
        envelope, wire = self._prepare(
            Kind.REQUEST, target, channel, topic, header, frames, timeout_ms=max(1, round(timeout_s * 1000))
        )
        future = self._pending.add(envelope.msg_id, target, channel, topic, time.monotonic(), timeout_s)
        if not self._outbox.put((envelope, wire)):
            self._pending.fail(
                envelope.msg_id, Status.CLOSED, f"cell {self._fqcn!r} stopped before the request was sent"
            )
        return future

    def send(
        self,
        target: str,
        channel: str,
        topic: str,
        header: Mapping[str, Any] | None = None,
        frames: Sequence[Any] = (),
    ) -> None:
        """Send a message that expects no reply (fire and forget).

        Delivery failures (target unreachable, no handler) are counted and logged by the cells
        that see them, not reported back. Frames are sent zero-copy: do not modify them.

        Raises:
            CellMessageTooLargeError: The message exceeds ``max_message_size_bytes``.
            CellClosedError: This cell is not running.
        """
        envelope, wire = self._prepare(Kind.SEND, target, channel, topic, header, frames)
        if not self._outbox.put((envelope, wire)):
            raise CellClosedError(
                f"cell {self._fqcn!r} stopped; message to {target!r} (channel={channel!r}, topic={topic!r}) not sent"
            )

    def forget_peer(self, fqcn: str, reason: str) -> None:
        """Server cell: unregister the cell ``fqcn`` (and its children) now, as its process is known to have ended.

        Requests waiting for its replies fail UNREACHABLE with ``reason`` at once instead of after
        the heartbeat timeout. A cell of that name that connects again registers afresh.
        """
        if not self._outbox.put(ForgetPeerCommand(fqcn, reason)):
            raise CellClosedError(f"cell {self._fqcn!r} stopped")

    def broadcast(
        self,
        targets: Iterable[str],
        channel: str,
        topic: str,
        header: Mapping[str, Any] | None = None,
        frames: Sequence[Any] = (),
        timeout_s: float | None = None,
    ) -> dict[str, Message]:
        """Send one request to several cells and wait for all replies.

        Failures do not raise: each target's entry carries its status (ok, error, timeout,
        unreachable) and reason. Body frames are shared, not copied, between the targets.

        Args:
            targets: FQCNs to ask (duplicates are asked once).
            channel: Handler channel.
            topic: Handler topic.
            header: Small msgpack-serializable dict.
            frames: Body frames.
            timeout_s: Bound on the whole call in seconds (default
                ``settings.request_timeout_s``).

        Returns:
            Reply per target, in the order given.
        """
        timeout_s = self._timeout(timeout_s)
        futures = {t: self.request_async(t, channel, topic, header, frames, timeout_s) for t in dict.fromkeys(targets)}
        deadline_s = time.monotonic() + timeout_s
        replies: dict[str, Message] = {}
        for target, future in futures.items():
            try:
                replies[target] = future.result(max(0.0, deadline_s - time.monotonic()))
            except concurrent.futures.TimeoutError:
                self._pending.fail(future.msg_id, Status.TIMEOUT, f"{self._fqcn}: no reply within {timeout_s:g} s")
                replies[target] = future.result(timeout=SETTLE_GRACE_S)
        return replies

    # ----------------------------------------------------------------- internals

    def _next_id(self) -> int:
        return next(self._ids)

    def _timeout(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self._settings.request_timeout_s
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        return float(timeout_s)

    def _prepare(
        self,
        kind: Kind,
        target: str,
        channel: str,
        topic: str,
        header: Mapping[str, Any] | None,
        frames: Sequence[Any],
        timeout_ms: int = 0,
    ) -> tuple[Envelope, list[Any]]:
        if self._state != _RUNNING:
            raise CellClosedError(
                f"cell {self._fqcn!r} is not running; message to {target!r} "
                f"(channel={channel!r}, topic={topic!r}) not sent"
            )
        envelope = new_envelope(kind, self._next_id(), self._fqcn, target, channel, topic, header, timeout_ms)
        return envelope, frame_message(envelope, frames, self._settings.max_message_size_bytes)

    def _dispatch(self, action: Dispatch) -> None:
        """Called on the I/O thread: run an inline handler here, hand any other to the pool."""
        if isinstance(action.handler, InlineHandler):
            if action.handler.runs_inline(action.message):
                reply = self._run_handler(action)
                if reply is not None:
                    self._io.send_now(*reply)
                return
            action = Dispatch(action.handler.handler, action.message)
        peer = action.message.source.split(".", 1)[0]  # a site and its child cells share one share
        # The reply the job returns goes to the outbox (the pool's on_result).
        if self._pool.submit(lambda: self._run_handler(action), peer, action.message.body_bytes):
            return
        if self._state != _RUNNING:
            logger.debug("message dropped at stop: channel=%s topic=%s", action.message.channel, action.message.topic)
            return
        self._core.count("peer_busy")
        REFUSALS.warning(logger, "request refused: %s has too many requests (or bytes) waiting for a handler", peer)
        request = action.message.envelope
        if request.kind is Kind.REQUEST:
            reason = f"{self._fqcn}: too many requests of {peer} are waiting for a handler; try again later"
            answer = request.reply(self._next_id(), Status.ERROR, reason)
            self._io.send_now(answer, [encode_envelope(answer)])

    def _run_handler(self, action: Dispatch) -> tuple[Envelope, list[Any]] | None:
        """Runs on a pool thread (or inline on the I/O thread): call the handler, return its reply to send."""
        return run_handler(
            action.handler,
            action.message,
            next_id=self._next_id,
            limit_bytes=self._settings.max_message_size_bytes,
            count=self._core.count,
        )
