"""`ChunkPuller`: keeps a download's chunk requests in flight, places each reply, asks again for the ones lost.

A chunk request that times out or meets a lost connection is asked again after a backoff
(`engine.cells.retry.RetryPolicy`); only that chunk is asked for, so the download resumes at the
first byte that has not landed and never pulls again what did. Each attempt is a new request:
a reply that comes after its attempt was given up on is dropped by the cell and never placed.
The download fails when a chunk has used its retries, when the sender refuses one, when the
sender has been unreachable for longer than the cell's heartbeat timeout, or at once when the
receiver no longer wants it (its ``stop`` event: the round or the job ended). Time spent waiting on
an unreachable or silent sender does not count against the stream's throughput deadline.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time

from engine.cells import Cell, Message
from engine.cells.protocol import STOP_POLL_S
from engine.cells.retry import NO_RETRY, RETRYABLE, Absence, RetryPolicy, give_up_reason
from engine.errors import StreamingError
from engine.streaming.consumers import ChunkConsumer
from engine.streaming.service import CHANNEL, TOPIC_CHUNK

log = logging.getLogger(__name__)

#: Seconds beyond a request's own timeout that the puller waits for the cell to resolve it.
RESOLVE_MARGIN_S = 5.0


class ChunkPuller:
    """Keeps ``max_in_flight`` chunk requests out, places each reply as it lands, retries lost ones.

    A consumer that places chunks in memory (``places_on_io_thread``) takes each reply in the
    request's callback, on the cell's I/O thread, which also asks for the next chunk: a chunk
    then costs no hand-off between threads (about a tenth of a receiver's CPU per GiB on a
    2-core VM). Any other consumer (files, which may block on the disk) takes chunks on the
    calling thread, so the I/O thread never waits on it. Retries are asked from the calling
    thread once their backoff is over.

    Args:
        cell: The receiving cell.
        source: The sending cell.
        ref: The download's ref id.
        consumer: Where chunks land.
        timeout_s: Longest wait for one chunk request, in seconds.
        max_in_flight: Chunk requests kept outstanding at once.
        deadline: ``time.monotonic()`` by which the whole stream must be in (``math.inf``: none),
            pushed back by the time the sender was away: at most one chunk's retries in all (every
            attempt timed out, and the waits between), so a sender that lets chunk after chunk
            time out and then answers cannot keep the stream going for ever.
        where: The download, for messages.
        policy: How lost chunk requests are asked again.
        stop: Set when the receiver no longer wants the download: the pull then fails at once
            (looked at every `STOP_POLL_S`). None: it runs to its end.
    """

    def __init__(
        self,
        cell: Cell,
        source: str,
        ref: str,
        consumer: ChunkConsumer,
        timeout_s: float,
        max_in_flight: int,
        deadline: float,
        where: str,
        policy: RetryPolicy = NO_RETRY,
        stop: threading.Event | None = None,
    ) -> None:
        self._cell, self._source, self._ref = cell, source, ref
        self._consumer, self._timeout_s, self._where = consumer, timeout_s, where
        self._deadline = deadline
        self._pushed_back_s = 0.0  # how far the deadline was pushed back by the sender's absences
        self._push_back_limit_s = (policy.retries + 1) * timeout_s + policy.window_s()
        self._max_in_flight = max_in_flight
        self._policy = policy
        self._stop = stop
        self._absence = Absence(policy.limit_for(cell))
        self._on_io_thread = consumer.places_on_io_thread
        self._lock = threading.Lock()  # guards the counters, the retries and the error
        self._place_lock = threading.Lock()  # one accept at a time
        self._landed: queue.SimpleQueue[tuple[int, Message] | None] = queue.SimpleQueue()
        self._wake = threading.Event()  # a retry was scheduled, or the pull finished
        self._finished = threading.Event()
        self._next_index = 0
        self._outstanding = 0  # chunks asked for (or waiting for a retry) that have not landed
        self._replies = 0
        self._attempts: dict[int, int] = {}  # index -> retries asked so far
        self._retries: list[tuple[float, int]] = []  # (due, index): a heap
        self._stalled_since: float | None = None  # a chunk failed and none landed since
        self._error: BaseException | None = None
        #: Chunk requests asked again (a figure for logs and tests).
        self.retried = 0

    def run(self) -> None:
        """Pull every chunk; raise the first failure (`StreamingError` for a refused or lost chunk)."""
        if self._consumer.chunk_count == 0:
            return
        for _ in range(min(self._max_in_flight, self._consumer.chunk_count)):
            self._ask()
        # The cell resolves every request by its own timeout; the margin only guards that.
        guard_s = self._timeout_s + RESOLVE_MARGIN_S
        last_progress = (time.monotonic(), 0)
        while not self._finished.is_set():
            now = time.monotonic()
            left_s = self._deadline_now(now) - now
            if left_s <= 0:
                self._fail(self._too_slow())
                continue
            if self._stop is not None and self._stop.is_set():
                self._fail(StreamingError(f"{self._where}: stopped, the receiver no longer wants it"))
                continue
            due_s = self._ask_due_retries(now)
            wait_s = min(guard_s, left_s, due_s, STOP_POLL_S if self._stop is not None else guard_s)
            if self._on_io_thread:
                self._wake.wait(wait_s)
                self._wake.clear()
            else:
                try:
                    landed = self._landed.get(timeout=wait_s)
                except queue.Empty:
                    landed = None
                if landed is not None:
                    self._take(*landed)
            now = time.monotonic()
            with self._lock:
                progress, waiting = self._replies, bool(self._retries)
            if progress != last_progress[1] or waiting:
                last_progress = (now, progress)
            elif now - last_progress[0] > guard_s:
                self._fail(StreamingError(f"{self._where}: no chunk arrived within {self._timeout_s:g} s"))
        if self._error is not None:
            with self._place_lock:  # no chunk is being placed once the caller aborts the consumer
                pass
            raise self._error

    def _deadline_now(self, now: float) -> float:
        """The stream's deadline, pushed back by the time since the last chunk failed with none landing."""
        with self._lock:
            stalled, pushed_back_s = self._stalled_since, self._pushed_back_s
        pushed_back_s += now - stalled if stalled is not None else 0.0
        return self._deadline + min(pushed_back_s, self._push_back_limit_s)

    def _too_slow(self) -> StreamingError:
        with self._lock:
            landed = self._replies
        return StreamingError(
            f"{self._where}: the sender is too slow: {landed} of {self._consumer.chunk_count} chunks of "
            f"{self._consumer.total_bytes} bytes arrived by the stream's deadline (streaming_min_throughput)"
        )

    def _ask_due_retries(self, now: float) -> float:
        """Ask again for the chunks whose backoff is over; return seconds until the next one is due."""
        while True:
            with self._lock:
                if self._error is not None or not self._retries:
                    return float("inf")
                due, index = self._retries[0]
                if due > now:
                    return due - now
                heapq.heappop(self._retries)
                self.retried += 1
            self._request(index)

    def _ask(self) -> None:
        """Ask for the next chunk not asked for yet, if any."""
        with self._lock:
            if self._error is not None or self._next_index >= self._consumer.chunk_count:
                return
            index = self._next_index
            self._next_index += 1
            self._outstanding += 1
        self._request(index)

    def _request(self, index: int) -> None:
        try:
            future = self._cell.request_async(
                self._source, CHANNEL, TOPIC_CHUNK, {"ref": self._ref, "index": index}, timeout_s=self._timeout_s
            )
        except Exception as e:  # the cell stopped: no reply will ever come for this one
            with self._lock:
                self._outstanding -= 1
            self._fail(StreamingError(f"{self._where}: chunk {index} could not be requested: {e}"))
            return
        future.add_done_callback(lambda done: self._on_reply(index, done.result()))

    def _on_reply(self, index: int, reply: Message) -> None:
        if self._on_io_thread or (not reply.ok and reply.status in RETRYABLE):
            self._take(index, reply)
        else:
            self._landed.put((index, reply))

    def _take(self, index: int, reply: Message) -> None:
        error: BaseException | None = None
        if not reply.ok:
            why = self._retry_later(index, reply) if reply.status in RETRYABLE else reply.reason
            if why is None:  # asked again once its backoff is over
                return
            error = StreamingError(f"{self._where}: chunk {index} failed ({reply.status.value}): {why}")
        else:
            self._heard()
            self._ask()  # before placing this chunk, so the pipe stays full
            try:
                with self._place_lock:
                    if self._error is None:
                        self._consumer.accept(index, reply.frames)
            except BaseException as e:  # reported to run(), which aborts the consumer
                error = e
        with self._lock:
            self._outstanding -= 1
            self._replies += 1
            done = self._outstanding == 0
        if error is not None:
            self._fail(error)
        elif done:
            self._finished.set()
            self._wake.set()

    def _heard(self) -> None:
        """A chunk landed: the sender is here; the time it was away no longer runs against the deadline."""
        self._absence.heard()
        with self._lock:
            stalled, self._stalled_since = self._stalled_since, None
            if stalled is not None:
                self._pushed_back_s += time.monotonic() - stalled

    def _retry_later(self, index: int, reply: Message) -> str | None:
        """Schedule chunk ``index`` again after a lost attempt; return why not when the failure is final."""
        now = time.monotonic()
        with self._lock:
            attempt = self._attempts.get(index, 0)
        why = give_up_reason(reply.status, reply.reason, attempt, self._policy, self._absence, now, self._source)
        if why is not None:
            return why
        wait_s = self._policy.wait_s(attempt + 1)
        with self._lock:
            if self._error is not None:
                return f"{reply.reason} (the download failed meanwhile)"
            self._attempts[index] = attempt + 1
            if self._stalled_since is None:
                self._stalled_since = now
            heapq.heappush(self._retries, (now + wait_s, index))
        log.info(
            "%s: chunk %d lost (%s), asking again in %.2f s (retry %d of %d)",
            self._where, index, reply.status.value, wait_s, attempt + 1, self._policy.retries,
        )  # fmt: skip
        self._wake_run()
        return None

    def _wake_run(self) -> None:
        """Wake `run` (waiting for a landed chunk, or for the pull to finish)."""
        self._wake.set()
        if not self._on_io_thread:
            self._landed.put(None)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._finished.set()
        self._wake_run()
