"""`SiteLiveness`: which client sites of a running job are dead, why, and which came back.

The server job marks a site dead when its parent tells it the site's job process ended (the
simulator's launcher, the server daemon), when the site sends no heartbeat for the heartbeat
timeout, or when the site's key is revoked. A dead site's open tasks end ``CLIENT_DEAD`` in the
task queue and workflows leave it out; one that asks for work again (its job process was started
again, or it was only away) is back, unless it was revoked. Every death and return is kept, in
order, for the job's summary.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from engine.controller import TaskQueue


class SiteLiveness:
    """The dead sites of one job and their history; safe to share between threads.

    Args:
        clients: The job's client sites.
    """

    def __init__(self, clients: list[str]) -> None:
        self._clients = set(clients)
        self._lock = threading.Lock()
        self._dead: dict[str, str] = {}  # site -> why it is dead
        self._revoked: set[str] = set()  # never back: the job's port refuses them
        self._queue: TaskQueue | None = None
        #: Deaths and returns in order: ``{"event": "client_dead" | "client_back", "site", "reason"?, "at"}``.
        self.events: list[dict[str, Any]] = []

    def is_client(self, site: str) -> bool:
        """Whether ``site`` is one of the job's client sites."""
        return site in self._clients

    def attach(self, queue: TaskQueue) -> None:
        """Use ``queue`` from now on; the sites found dead before it existed are dead in it too."""
        with self._lock:
            self._queue = queue
            dead = list(self._dead)
        for site in dead:
            queue.client_dead(site)

    def mark_dead(self, site: str, reason: str) -> bool:
        """``site`` is dead for ``reason``; False when it already was."""
        with self._lock:
            if site in self._dead:
                return False
            self._dead[site] = reason
            self.events.append({"event": "client_dead", "site": site, "reason": reason, "at": round(time.time(), 3)})
            queue = self._queue
        if queue is not None:
            queue.client_dead(site)
        return True

    def revoke(self, site: str) -> None:
        """``site`` was revoked: it never comes back (mark it dead as well)."""
        with self._lock:
            self._revoked.add(site)

    def revoked(self) -> set[str]:
        """The revoked sites."""
        with self._lock:
            return set(self._revoked)

    def back(self, site: str) -> str | None:
        """``site`` asked for work: if it was dead (and not revoked) it is alive again; return why it was dead."""
        with self._lock:
            if site in self._revoked:
                return None
            reason = self._dead.pop(site, None)
            if reason is not None:
                self.events.append({"event": "client_back", "site": site, "at": round(time.time(), 3)})
            queue = self._queue
        if reason is not None and queue is not None:
            queue.client_back(site)
        return reason

    def dead(self) -> dict[str, str]:
        """The dead sites now, with why."""
        with self._lock:
            return dict(self._dead)
