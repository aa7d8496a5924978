"""A fixed set of daemon threads that run handlers off the I/O thread.

Not a ``ThreadPoolExecutor``: its workers are joined at interpreter exit, so one handler stuck
forever would hang process exit. Here ``stop`` waits for running handlers only until its
deadline, then leaves them behind as daemon threads and says so in the log.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_STOP = None


class HandlerPool:
    """Bounded pool of worker threads fed by one queue.

    Args:
        size: Number of worker threads.
        name: Prefix of the thread names (the cell's FQCN).
    """

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"handler pool size must be >= 1, got {size}")
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
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

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue a job; return False (and drop it) once the pool is stopping."""
        if self._stopped:
            return False
        self._queue.put(job)
        return True

    def stop(self, deadline_s: float) -> int:
        """Stop taking jobs, let the workers finish, and wait until ``deadline_s`` at most.

        Args:
            deadline_s: Monotonic time after which waiting stops.

        Returns:
            How many workers were still busy at the deadline.
        """
        self._stopped = True
        if not self._started:
            return 0
        dropped = 0
        while True:  # jobs not started yet are dropped: their requesters get a BYE instead
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            dropped += 1
        if dropped:
            logger.info("handler pool dropped %d queued job(s) at stop", dropped)
        for _ in self._threads:
            self._queue.put(_STOP)
        me = threading.current_thread()  # a handler may stop its own cell
        for thread in self._threads:
            if thread is not me:
                thread.join(max(0.0, deadline_s - time.monotonic()))
        busy = sum(thread.is_alive() and thread is not me for thread in self._threads)
        if busy:
            logger.warning("handler pool stopped with %d handler(s) still running", busy)
        return busy

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                job()
            except Exception:  # a job reports its own errors; this is the last guard
                logger.exception("handler job failed")
