"""`DownloadRegistry`: the sender's book of downloadables, their receivers and their deadlines.

Plain bookkeeping, no sockets: the download service asks it to answer each chunk request, and
it frees a downloadable when every receiver has finished (or was refused past its share of
requests), when its transaction times out (a receiver vanished), when its owner drops it, or
when the job ends. A held transaction (its receiver may pull it again later: a server that
folded a result into a sum may need it once more) does not time out.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.cells.retry import DEFAULT_RETRIES
from engine.errors import DownloadRefused, StreamingError
from engine.streaming.downloadable import Downloadable

log = logging.getLogger(__name__)

#: What a wait for a download's receivers to finish lasts at most, by default: a receiver that
#: keeps asking for something (a chunk now and then, the stream's info) without ever finishing
#: would otherwise hold the waiter (a server's handler thread, say) for as long as it likes.
LONGEST_WAIT_S = 60.0
#: Pulls of one download a receiver may make: its pull and a pull again into a rebuilt sum.
PULLS_PER_RECEIVER = 2
#: Chunk requests a receiver is served beyond `PULLS_PER_RECEIVER` x (retries + 1) x the chunks.
SERVED_SLACK = 64
#: How many times one receiver may be given a download's info (each pull asks once, and again
#: after a lost answer).
MAX_INFO_SERVED = 32


def chunk_requests_allowed(chunk_count: int, retries: int) -> int:
    """Chunk requests one receiver is served of a download of ``chunk_count`` chunks at most.

    Each of its pulls may ask every chunk ``retries + 1`` times (a late answer was still served),
    and it may pull `PULLS_PER_RECEIVER` times; a receiver that asks for the same chunks without
    end (the sender's CPU, its link, a quantized chunk encoded again each time) is refused past it.
    """
    return PULLS_PER_RECEIVER * (retries + 1) * chunk_count + SERVED_SLACK


@dataclass
class _Transaction:
    downloadable: Downloadable
    receivers: frozenset[str]
    timeout_s: float
    deadline: float
    done: set[str] = field(default_factory=set)
    held: bool = False
    pulled: set[str] = field(default_factory=set)  # receivers that asked for it at least once
    chunk_requests_allowed: int = 0  # per receiver
    chunks_served: dict[str, int] = field(default_factory=dict)  # receiver -> chunk requests answered
    infos_served: dict[str, int] = field(default_factory=dict)  # receiver -> info requests answered


class DownloadRegistry:
    """Downloadables by ref id, each served to a set of receivers until they are all done.

    Args:
        clock: Seconds, monotonic; tests pass their own.
        retries: The receivers' ``streaming_retries`` (this side's): each chunk may be asked that
            many times again in a pull (see `chunk_requests_allowed`).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, retries: int = DEFAULT_RETRIES) -> None:
        self._clock = clock
        self._retries = retries
        self._transactions: dict[str, _Transaction] = {}
        self._lock = threading.Lock()
        self._gone = threading.Condition(self._lock)  # notified whenever transactions end
        self._closed = False

    def add(self, downloadable: Downloadable, receivers: Iterable[str], timeout_s: float) -> str:
        """Register ``downloadable`` for ``receivers``; return its ref id.

        Args:
            downloadable: What to serve.
            receivers: Names of the cells that will download it, and the only ones that may
                (all of them must finish before it is freed). The names are the ones the cells
                layer authenticated, so a ref that leaks to another cell is of no use to it.
            timeout_s: Seconds without any request after which the transaction is dropped.

        Raises:
            StreamingError: The registry is closed (the job ended), or no receiver is named;
                the caller still owns ``downloadable``.
        """
        ref = uuid.uuid4().hex
        members = frozenset(receivers) if receivers is not None else frozenset()
        if not members:
            raise StreamingError("a download must name the cells that may pull it; none was given")
        with self._lock:
            if self._closed:
                raise StreamingError("the download service is closed: nothing more can be offered")
            self._transactions[ref] = _Transaction(
                downloadable,
                members,
                timeout_s,
                self._clock() + timeout_s,
                chunk_requests_allowed=chunk_requests_allowed(downloadable.chunk_count, self._retries),
            )
        return ref

    def lookup(self, ref: str, requester: str) -> Downloadable:
        """Return the downloadable ``ref`` for ``requester`` (its info) and push the transaction's deadline.

        Raises:
            DownloadRefused: Unknown or finished ref, or a requester that is not a receiver
                (the same message for both); or a requester given the info `MAX_INFO_SERVED`
                times already (it then counts as done with the download).
        """
        with self._lock:
            transaction = self._find(ref, requester)
            served = transaction.infos_served.get(requester, 0)
            if served < MAX_INFO_SERVED:
                transaction.infos_served[requester] = served + 1
                self._asked(transaction, requester)
                return transaction.downloadable
            freed = self._done_with(ref, transaction, requester)
        if freed:
            transaction.downloadable.release()
        raise DownloadRefused(f"download {ref!r}: its info was given to {requester} {served} times already; refused")

    def _find(self, ref: str, requester: str) -> _Transaction:
        """The transaction ``ref`` of ``requester`` (called under the lock)."""
        transaction = self._transactions.get(ref) if isinstance(ref, str) else None
        if transaction is not None and requester not in transaction.receivers:
            # Answered exactly as an unknown ref, so that a peer learns nothing of other
            # cells' downloads by asking for them.
            log.warning("download refused to a cell it was not offered to: ref=%s requester=%s", ref, requester)
            transaction = None
        if transaction is None:
            raise DownloadRefused(f"unknown or finished download {ref!r}")
        return transaction

    def _asked(self, transaction: _Transaction, requester: str) -> None:
        """A request of ``requester`` was answered: the transaction's deadline is pushed back (under the lock).

        Not for a refused one: a receiver refused past its share cannot keep the download alive.
        """
        transaction.deadline = self._clock() + transaction.timeout_s
        transaction.pulled.add(requester)

    def serves_from_memory(self, ref: object) -> bool:
        """Whether chunks of ``ref`` come straight from memory (see `Downloadable.in_memory`).

        True for an unknown ref too: its answer is an error, quick to make.
        """
        with self._lock:
            transaction = self._transactions.get(ref) if isinstance(ref, str) else None
        return transaction is None or transaction.downloadable.in_memory

    def chunk(self, ref: str, requester: str, index: int) -> list[memoryview]:
        """Serve chunk ``index`` of ``ref`` to ``requester`` (see `lookup`).

        Raises:
            DownloadRefused: As `lookup`, an index out of range, or a requester served
                `chunk_requests_allowed` already (it then counts as done with the download).
        """
        with self._lock:
            transaction = self._find(ref, requester)
            downloadable = transaction.downloadable
            if type(index) is not int or not 0 <= index < downloadable.chunk_count:
                raise DownloadRefused(
                    f"chunk {index!r} is out of range: download {ref!r} has {downloadable.chunk_count} chunks"
                )
            served = transaction.chunks_served.get(requester, 0)
            if served < transaction.chunk_requests_allowed:
                transaction.chunks_served[requester] = served + 1
                self._asked(transaction, requester)
                return downloadable.chunk(index)
            freed = self._done_with(ref, transaction, requester)
        if freed:
            downloadable.release()
        raise DownloadRefused(
            f"download {ref!r}: {requester} was served {served} chunk requests of its {downloadable.chunk_count} "
            f"chunks already, all it may ask for with {self._retries} retries; refused"
        )

    def _done_with(self, ref: str, transaction: _Transaction, receiver: str) -> bool:
        """Record ``receiver`` as done with ``ref``; True when it was the last: ``ref`` is gone (under the lock).

        The caller releases the downloadable once the lock is free. A receiver refused past its
        share is done too: it gets nothing more, and must not keep the download alive.
        """
        transaction.done.add(receiver)
        if not transaction.receivers <= transaction.done:
            return False
        del self._transactions[ref]
        self._gone.notify_all()
        return True

    def finish(self, ref: str, receiver: str) -> bool:
        """Record that ``receiver`` has everything; free the downloadable when all have. Return True if freed."""
        with self._lock:
            transaction = self._transactions.get(ref) if isinstance(ref, str) else None
            if transaction is None or receiver not in transaction.receivers:
                return False  # only a receiver it was offered to can say it is done
            freed = self._done_with(ref, transaction, receiver)
        if freed:
            transaction.downloadable.release()
            log.debug("download finished ref=%s receivers=%d", ref, len(transaction.done))
        return freed

    def never_pulled(self, refs: Iterable[str]) -> set[str]:
        """The receivers of the open transactions ``refs`` that have not asked for a single chunk yet."""
        with self._lock:
            open_ = [self._transactions[ref] for ref in set(refs) if ref in self._transactions]
            return {name for t in open_ for name in t.receivers - t.done - t.pulled}

    def hold(self, refs: Iterable[str]) -> None:
        """Keep the transactions ``refs`` past their deadline, until their receivers finish or `drop`."""
        with self._lock:
            for ref in refs:
                transaction = self._transactions.get(ref)
                if transaction is not None:
                    transaction.held = True

    def drop(self, refs: Iterable[str]) -> list[str]:
        """Free the transactions ``refs`` whatever their receivers did; return the ref ids that were open."""
        with self._lock:
            dropped = {ref: self._transactions.pop(ref) for ref in set(refs) if ref in self._transactions}
            if dropped:
                self._gone.notify_all()
        for ref, transaction in dropped.items():
            log.debug("download dropped by its owner ref=%s", ref)
            transaction.downloadable.release()
        return list(dropped)

    def expire(self) -> list[str]:
        """Drop every transaction past its deadline (held ones excepted); return their ref ids."""
        now = self._clock()
        with self._lock:
            expired = {ref: t for ref, t in self._transactions.items() if t.deadline <= now and not t.held}
            for ref in expired:
                del self._transactions[ref]
            if expired:
                self._gone.notify_all()
        for ref, transaction in expired.items():
            pending = sorted(transaction.receivers - transaction.done)
            log.warning("download timed out ref=%s unfinished_receivers=%s", ref, pending)
            transaction.downloadable.release()
        return list(expired)

    def close(self) -> None:
        """Drop every transaction and refuse new ones (the job ends)."""
        with self._lock:
            self._closed = True
            transactions, self._transactions = list(self._transactions.values()), {}
            self._gone.notify_all()
        for transaction in transactions:
            transaction.downloadable.release()

    def wait_finished(
        self,
        refs: Iterable[str],
        idle_limit_s: float,
        stop: threading.Event | None = None,
        longest_s: float = LONGEST_WAIT_S,
    ) -> bool:
        """Wait until the transactions ``refs`` have ended (every receiver finished, or dropped).

        Returns:
            True once they have; False as soon as every one still open has had no request for
            ``idle_limit_s`` seconds (its receivers are not pulling: gone, or stuck), after
            ``longest_s`` seconds whatever the receivers do (one that keeps asking without ever
            finishing holds the waiter no longer), or when ``stop`` is set.
        """
        return self._wait(refs, idle_limit_s, stop, longest_s, lambda transaction: True)

    def wait_pulls_finished(
        self,
        refs: Iterable[str],
        idle_limit_s: float,
        stop: threading.Event | None = None,
        longest_s: float = LONGEST_WAIT_S,
    ) -> bool:
        """Wait until every receiver that has begun to pull the transactions ``refs`` has finished.

        Receivers that have not asked for a chunk are not waited for (a simulation's virtual
        clients that wait for their turn); they may still pull later. Returns as `wait_finished`.
        """
        return self._wait(refs, idle_limit_s, stop, longest_s, lambda t: bool((t.pulled & t.receivers) - t.done))

    def _wait(
        self,
        refs: Iterable[str],
        idle_limit_s: float,
        stop: threading.Event | None,
        longest_s: float,
        waits_for: Callable[[_Transaction], bool],
    ) -> bool:
        refs = set(refs)
        with self._gone:
            until = self._clock() + longest_s
            while True:
                open_ = [t for ref in refs if (t := self._transactions.get(ref)) is not None and waits_for(t)]
                if not open_:
                    return True
                now = self._clock()
                if (stop is not None and stop.is_set()) or now >= until:
                    return False
                if all(now - (t.deadline - t.timeout_s) >= idle_limit_s for t in open_):
                    return False
                self._gone.wait(0.2)

    def __len__(self) -> int:
        with self._lock:
            return len(self._transactions)
