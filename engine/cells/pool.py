"""A fixed set of daemon threads that run handlers off the I/O thread, shared fairly between peers.

Not a ``ThreadPoolExecutor``: its workers are joined at interpreter exit, so one handler stuck
forever would hang process exit. Here ``stop`` waits for running handlers only until its
deadline, then leaves them behind as daemon threads and says so in the log.

Jobs are queued per *peer* (the site a message came from): one peer runs at most
``per_peer_limit`` handlers at once, and the workers take the peers that have work in turn, so
a site that floods the cell with slow requests holds a bounded share of the threads and the
other sites' requests still run. A peer's queue is bounded too, by count and by bytes (the
received messages it holds); past either, ``submit`` refuses.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Jobs one peer may have waiting for a thread; past it the cell answers "busy".
DEFAULT_QUEUED_PER_PEER = 1024
#: Bytes of received messages one peer may have waiting for a thread (one message is always let
#: in, however large: the cell's message size limit bounds that one).
DEFAULT_QUEUED_BYTES_PER_PEER = 256 << 20


class HandlerPool:
    """Bounded pool of worker threads fed by per-peer queues, served in turn.

    Args:
        size: Number of worker threads.
        name: Prefix of the thread names (the cell's FQCN).
        per_peer_limit: Handlers one peer may run at once (default: half the threads, at
            least one).
        queued_per_peer: Jobs one peer may have waiting.
        queued_bytes_per_peer: Bytes one peer's waiting jobs may hold (the ``size`` given to
            `submit`); a job is let in past it only when the peer has none waiting.
        on_result: Called on the worker with what a job returned, when not None, as the last
            thing before the worker sleeps or takes its next job (a cell queues the handler's
            reply there: the I/O thread it wakes then finds the GIL free).
    """

    def __init__(
        self,
        size: int,
        name: str,
        per_peer_limit: int | None = None,
        queued_per_peer: int = DEFAULT_QUEUED_PER_PEER,
        queued_bytes_per_peer: int = DEFAULT_QUEUED_BYTES_PER_PEER,
        on_result: Callable[[Any], object] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"handler pool size must be >= 1, got {size}")
        self.per_peer_limit = per_peer_limit if per_peer_limit is not None else max(1, size // 2)
        self._queued_per_peer = queued_per_peer
        self._queued_bytes_per_peer = queued_bytes_per_peer
        self._on_result = on_result
        self._queues: dict[str, collections.deque[tuple[Callable[[], Any], int]]] = {}
        # Plain dicts, not Counters: a Counter's missing key is a Python-level call, per job.
        self._queued_bytes: dict[str, int] = {}
        self._running: dict[str, int] = {}
        self._turns: collections.deque[str] = collections.deque()  # peers with work, in turn
        self._condition = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-handler-{i}", daemon=True) for i in range(size)
        ]
        self._started = False
        self._stopped = False

    def start(self) -> None:
        """Start the worker threads."""
        if not self._started:
            self._started = True
            for thread in self._threads:
                thread.start()

    def submit(self, job: Callable[[], Any], peer: str = "", size: int = 0) -> bool:
        """Queue a job of ``peer`` that holds ``size`` bytes; return False (and drop it) when
        stopping or the peer's queue is full (by count, or by bytes while it holds any job)."""
        with self._condition:
            if self._stopped:
                return False
            waiting = self._queues.setdefault(peer, collections.deque())
            if len(waiting) >= self._queued_per_peer:
                return False
            queued_bytes = self._queued_bytes.get(peer, 0)
            if waiting and queued_bytes + size > self._queued_bytes_per_peer:
                return False
            waiting.append((job, size))
            self._queued_bytes[peer] = queued_bytes + size
            if peer not in self._turns:
                self._turns.append(peer)
            self._condition.notify()
        return True

    def running(self, peer: str) -> int:
        """Handlers of ``peer`` running now."""
        with self._condition:
            return self._running.get(peer, 0)

    def stop(self, deadline_s: float) -> int:
        """Stop taking jobs, let the workers finish, and wait until ``deadline_s`` at most.

        Args:
            deadline_s: Monotonic time after which waiting stops.

        Returns:
            How many workers were still busy at the deadline.
        """
        with self._condition:
            self._stopped = True
            # Jobs not started yet are dropped: their requesters get a BYE instead.
            dropped = sum(len(waiting) for waiting in self._queues.values())
            self._queues.clear()
            self._queued_bytes.clear()
            self._turns.clear()
            self._condition.notify_all()
        if dropped:
            logger.info("handler pool dropped %d queued job(s) at stop", dropped)
        if not self._started:
            return 0
        me = threading.current_thread()  # a handler may stop its own cell
        for thread in self._threads:
            if thread is not me:
                thread.join(max(0.0, deadline_s - time.monotonic()))
        busy = sum(thread.is_alive() and thread is not me for thread in self._threads)
        if busy:
            logger.warning("handler pool stopped with %d handler(s) still running", busy)
        return busy

    def _next(self) -> tuple[str, Callable[[], None]] | None:
        """The next job of the first peer in turn that is under its limit (call with the lock held)."""
        for _ in range(len(self._turns)):
            peer = self._turns.popleft()
            waiting = self._queues.get(peer)
            if not waiting:
                self._queues.pop(peer, None)
                continue
            running = self._running.get(peer, 0)
            if running >= self.per_peer_limit:
                self._turns.append(peer)  # its turn comes again when one of its handlers ends
                continue
            job, size = waiting.popleft()
            queued_bytes = self._queued_bytes.get(peer, 0) - size
            if queued_bytes:
                self._queued_bytes[peer] = queued_bytes
            else:
                self._queued_bytes.pop(peer, None)
            if waiting:
                self._turns.append(peer)
            else:
                del self._queues[peer]
            self._running[peer] = running + 1
            return peer, job
        return None

    def _work(self) -> None:
        finished: str | None = None  # the peer whose job this worker just ran
        result: Any = None  # what that job returned, for on_result
        while True:
            picked = None
            with self._condition:
                if finished is not None:
                    running = self._running[finished] - 1
                    if running:
                        self._running[finished] = running
                    else:
                        del self._running[finished]
                    if finished in self._queues:
                        # Its queue was held back by its limit: a job is runnable again. This
                        # worker takes the first runnable job below; wake another for the rest.
                        # With nothing queued, no other worker is woken: a wake-up that finds no
                        # work costs two context switches (and the GIL) on every request.
                        self._condition.notify()
                    finished = None
                stopped = self._stopped
                while not stopped:
                    picked = self._next()
                    if picked is not None or result is not None:
                        break  # a result is handed over before sleeping, outside the lock
                    self._condition.wait()
                    stopped = self._stopped
            if result is not None:
                # Last before the next job or sleep (the loop comes back to sleep at once): the
                # I/O thread woken by the hand-over then finds the GIL free soon. Also at stop:
                # a reply computed before it still goes out.
                self._hand_over(result)
                result = None
            if stopped:
                return
            if picked is None:
                continue
            finished, job = picked
            try:
                result = job()
            except Exception:  # a job reports its own errors; this is the last guard
                logger.exception("handler job failed")

    def _hand_over(self, result: Any) -> None:
        """Pass a job's result to ``on_result`` (errors are logged, never raised)."""
        if self._on_result is not None:
            try:
                self._on_result(result)
            except Exception:
                logger.exception("handler result not handed over")
