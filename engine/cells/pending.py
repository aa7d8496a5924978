"""Requests this cell sent and is waiting on, each with its own future and deadline.

Any thread adds entries (the caller of ``request``); the I/O thread resolves them as replies
arrive or fails them when their target becomes unreachable; either side may expire them. Every
entry is resolved exactly once: whoever pops it from the table sets its future.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import NamedTuple

from engine.cells.envelope import Envelope
from engine.cells.message import Message
from engine.cells.protocol import Kind, Status

logger = logging.getLogger(__name__)

_COMPACT_SLACK = 1024


class ReplyFuture(Future[Message]):
    """Future of a request's reply; knows the request's message id.

    Attributes:
        msg_id: Id of the request it belongs to.
    """

    def __init__(self, msg_id: int) -> None:
        super().__init__()
        self.msg_id = msg_id


class PendingRequest(NamedTuple):
    """One request awaiting its reply.

    Attributes:
        msg_id: Id of the request.
        target: FQCN the request went to; the reply must come from it.
        channel: Channel of the request.
        topic: Topic of the request.
        deadline_s: Monotonic time after which it fails with status timeout.
        timeout_s: The timeout it was given, for the error message.
        future: Resolved with the reply :class:`Message` (any status).
    """

    msg_id: int
    target: str
    channel: str
    topic: str
    deadline_s: float
    timeout_s: float
    future: ReplyFuture


class PendingRequests:
    """Thread-safe table of outstanding requests of one cell.

    Args:
        local_fqcn: Name of the owning cell, used as target of the failure replies it makes.
    """

    def __init__(self, local_fqcn: str) -> None:
        self._local_fqcn = local_fqcn
        self._lock = threading.Lock()
        self._entries: dict[int, PendingRequest] = {}
        self._deadlines: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self,
        msg_id: int,
        target: str,
        channel: str,
        topic: str,
        now_s: float,
        timeout_s: float,
    ) -> ReplyFuture:
        """Register a request before it is sent; return the future its reply will resolve."""
        future = ReplyFuture(msg_id)
        deadline_s = now_s + timeout_s
        entry = PendingRequest(msg_id, target, channel, topic, deadline_s, timeout_s, future)
        with self._lock:
            if msg_id in self._entries:
                raise ValueError(f"message id {msg_id} is already pending")
            self._entries[msg_id] = entry
            heapq.heappush(self._deadlines, (deadline_s, msg_id))
            if len(self._deadlines) > 2 * len(self._entries) + _COMPACT_SLACK:
                # Resolved requests leave their deadline behind; drop them before they pile up
                # (long timeouts at a high request rate would keep millions).
                self._deadlines = [(e.deadline_s, e.msg_id) for e in self._entries.values()]
                heapq.heapify(self._deadlines)
        return future

    def get(self, msg_id: int) -> PendingRequest | None:
        """Return the entry of a pending request, or None."""
        return self._entries.get(msg_id)

    def resolve(self, reply: Message) -> bool:
        """Complete the request that ``reply`` answers.

        Returns:
            False, leaving the table alone, when no request with that id is pending (late or
            duplicate reply) or when the reply does not come from the request's target.
        """
        msg_id = reply.envelope.reply_to
        with self._lock:
            entry = self._entries.get(msg_id) if msg_id is not None else None
            if entry is None or entry.target != reply.source:
                return False
            del self._entries[msg_id]
        _settle(entry.future, reply)
        return True

    def fail(self, msg_id: int, status: Status, reason: str) -> bool:
        """Complete one request with a failure status; False if it is no longer pending."""
        with self._lock:
            entry = self._entries.pop(msg_id, None)
        if entry is None:
            return False
        _settle(entry.future, self._failure(entry, status, reason))
        return True

    def fail_where(self, predicate: Callable[[PendingRequest], bool], status: Status, reason: str) -> int:
        """Complete every request matching ``predicate`` with a failure; return how many."""
        with self._lock:
            doomed = [e for e in self._entries.values() if predicate(e)]
            for entry in doomed:
                del self._entries[entry.msg_id]
        for entry in doomed:
            _settle(entry.future, self._failure(entry, status, reason))
        return len(doomed)

    def fail_target(self, target: str, status: Status, reason: str) -> int:
        """Complete every request sent to ``target`` with a failure; return how many."""
        return self.fail_where(lambda e: e.target == target, status, reason)

    def expire(self, now_s: float) -> int:
        """Fail every request whose deadline passed with status timeout; return how many."""
        expired: list[PendingRequest] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now_s:
                _, msg_id = heapq.heappop(self._deadlines)
                entry = self._entries.pop(msg_id, None)
                if entry is not None:
                    expired.append(entry)
            if not self._entries:
                self._deadlines.clear()
        for entry in expired:
            reason = f"{self._local_fqcn}: no reply within {entry.timeout_s:g} s"
            _settle(entry.future, self._failure(entry, Status.TIMEOUT, reason))
        return len(expired)

    def next_deadline_s(self) -> float | None:
        """Return the earliest deadline still queued (possibly of a resolved entry), or None.

        Read without the lock (the I/O thread asks every turn): the heap's first entry is read
        in one step, and the list is only ever pushed to, popped from or replaced whole.
        """
        try:
            return self._deadlines[0][0]
        except IndexError:
            return None

    def _failure(self, entry: PendingRequest, status: Status, reason: str) -> Message:
        envelope = Envelope(
            kind=Kind.REPLY,
            msg_id=0,
            source=entry.target,
            target=self._local_fqcn,
            channel=entry.channel,
            topic=entry.topic,
            reply_to=entry.msg_id,
            status=status,
            reason=reason,
        )
        return Message(envelope)


def _settle(future: ReplyFuture, message: Message) -> None:
    try:
        future.set_result(message)
    except InvalidStateError:  # the caller cancelled its future; nobody is waiting
        logger.debug("reply dropped: request future already cancelled")
