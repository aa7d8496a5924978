"""The one thread-safe way into the I/O thread: a queue plus a pollable wake-up descriptor.

API calls and handler threads ``put`` work here from any thread; the I/O thread polls
:meth:`Outbox.fileno` next to its ZeroMQ sockets. A wake-up byte is written only while the
I/O thread is asleep (between :meth:`Outbox.prepare_to_sleep` and :meth:`Outbox.woke`) and
has not been woken yet: waking a thread costs far more than queueing, so a busy I/O thread
picks work up on its next turn without any system call.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any


class Outbox:
    """Multi-producer, single-consumer queue whose readiness a ``zmq.Poller`` can watch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[Any] = collections.deque()
        self._sleeping = False
        self._signalled = False
        self._closed = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def fileno(self) -> int:
        """Descriptor that becomes readable when the sleeping consumer must wake."""
        return self._read_fd

    def put(self, item: Any) -> bool:
        """Queue an item, waking the consumer if it sleeps; False (item dropped) once closed."""
        with self._lock:
            if self._closed:
                return False
            self._items.append(item)
            if self._sleeping and not self._signalled:
                self._signalled = True
                # Written under the lock so that close() cannot free the descriptor in between.
                os.write(self._write_fd, b"\x01")
        return True

    def drain(self) -> list[Any]:
        """Take every queued item, oldest first (consumer thread only)."""
        with self._lock:
            if not self._items:
                return []
            items = list(self._items)
            self._items.clear()
        return items

    def prepare_to_sleep(self) -> bool:
        """Consumer: declare it is about to block; False if items arrived meanwhile."""
        with self._lock:
            if self._items:
                return False
            self._sleeping = True
            return True

    def woke(self) -> None:
        """Consumer: declare it is awake again, consuming the wake-up byte if one was sent."""
        with self._lock:
            self._sleeping = False
            if self._signalled:
                self._signalled = False
                try:
                    os.read(self._read_fd, 64)
                except BlockingIOError:
                    pass

    def close(self) -> list[Any]:
        """Refuse further items and return those never drained (consumer thread only)."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            items = list(self._items)
            self._items.clear()
        os.close(self._read_fd)
        os.close(self._write_fd)
        return items
