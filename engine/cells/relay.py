"""Requests the server forwarded between two other cells, so it can answer for a lost target.

When ``site-1`` asks ``site-2`` through the server and ``site-2`` vanishes, only the server
learns it (from its heartbeats). The relay table remembers each forwarded request until its
reply passes back, its timeout passes, or its target goes away; in the last case the server
answers the requester with status unreachable instead of letting it wait out its timeout.

What a requester announces cannot make the table grow without bound: one identity (a site with
its child cells) has at most `MAX_RELAYED_PER_IDENTITY` requests remembered at once, each for at
most `MAX_TTL_S` seconds, and only the first `MAX_NAME_CHARS` characters of its channel and
topic are kept.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq

_MIN_TTL_S = 1.0
_COMPACT_SLACK = 1024
#: Forwarded requests one identity may have waiting for replies; past it, refused.
MAX_RELAYED_PER_IDENTITY = 1024
#: The longest a forwarded request is remembered, whatever timeout its requester announced.
MAX_TTL_S = 24 * 3600.0
#: Characters of a request's channel and topic kept for the answer to a lost target.
MAX_NAME_CHARS = 128


def _identity(fqcn: str) -> str:
    return fqcn.split(".", 1)[0]


@dataclasses.dataclass(frozen=True, slots=True)
class RelayedRequest:
    """A request forwarded by the server.

    Attributes:
        source: FQCN of the requester.
        msg_id: The requester's message id.
        target: FQCN the request was forwarded to.
        channel: Channel of the request.
        topic: Topic of the request.
        deadline_s: Monotonic time after which the requester has given up.
    """

    source: str
    msg_id: int
    target: str
    channel: str
    topic: str
    deadline_s: float


class RelayTable:
    """Forwarded requests keyed by (requester, msg_id); owned by the server's I/O thread."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], RelayedRequest] = {}
        self._deadlines: list[tuple[float, str, int]] = []
        self._per_identity: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self,
        source: str,
        msg_id: int,
        target: str,
        channel: str,
        topic: str,
        now_s: float,
        timeout_s: float,
    ) -> bool:
        """Remember a forwarded request for ``timeout_s`` seconds (1 s to `MAX_TTL_S`).

        Returns:
            False (and nothing remembered) when the requester's identity has
            `MAX_RELAYED_PER_IDENTITY` requests waiting already: the caller refuses it.
        """
        key = (source, msg_id)
        if key not in self._entries:
            if self._per_identity[_identity(source)] >= MAX_RELAYED_PER_IDENTITY:
                return False
            self._per_identity[_identity(source)] += 1
        deadline_s = now_s + min(max(timeout_s, _MIN_TTL_S), MAX_TTL_S)
        self._entries[key] = RelayedRequest(
            source, msg_id, target, channel[:MAX_NAME_CHARS], topic[:MAX_NAME_CHARS], deadline_s
        )
        heapq.heappush(self._deadlines, (deadline_s, source, msg_id))
        if len(self._deadlines) > 2 * len(self._entries) + _COMPACT_SLACK:  # drop answered ones
            self._deadlines = [(r.deadline_s, r.source, r.msg_id) for r in self._entries.values()]
            heapq.heapify(self._deadlines)
        return True

    def _forget(self, key: tuple[str, int]) -> RelayedRequest:
        entry = self._entries.pop(key)
        identity = _identity(entry.source)
        self._per_identity[identity] -= 1
        if not self._per_identity[identity]:
            del self._per_identity[identity]
        return entry

    def complete(self, requester: str, msg_id: int, replier: str | None = None) -> RelayedRequest | None:
        """Forget a request whose reply is being forwarded back to ``requester``.

        With ``replier``, only when the request was forwarded to that cell: a reply from anyone
        else (a peer that guesses another's message id) leaves the entry alone.
        """
        entry = self._entries.get((requester, msg_id))
        if entry is None or (replier is not None and entry.target != replier):
            return None
        return self._forget((requester, msg_id))

    def drop_target(self, target: str) -> list[RelayedRequest]:
        """Remove and return the requests forwarded to a cell that went away."""
        lost = [r for r in self._entries.values() if r.target == target]
        for relayed in lost:
            self._forget((relayed.source, relayed.msg_id))
        return lost

    def drop_source(self, source: str) -> int:
        """Forget the requests of a requester that went away; return how many."""
        keys = [k for k in self._entries if k[0] == source]
        for key in keys:
            self._forget(key)
        return len(keys)

    def expire(self, now_s: float) -> int:
        """Forget requests whose requester has stopped waiting; return how many."""
        count = 0
        while self._deadlines and self._deadlines[0][0] <= now_s:
            deadline_s, source, msg_id = heapq.heappop(self._deadlines)
            entry = self._entries.get((source, msg_id))
            if entry is not None and entry.deadline_s == deadline_s:
                self._forget((source, msg_id))
                count += 1
        if not self._entries:
            self._deadlines.clear()
        return count
