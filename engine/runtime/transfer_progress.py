"""`DownloadProgress`: how far each client is in downloading its task's model, as rate-limited events.

The server's download service counts the chunk bytes it served to each requester
(`DownloadService.bytes_served`); this turns those counters into ``download_progress`` events
(site, task_id, bytes, total) for the live console, at most one per download every
`PROGRESS_INTERVAL_S`, plus one when the download is complete. A task sent inline (no streaming)
serves no chunk and gets no event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Seconds between two progress events of one download.
PROGRESS_INTERVAL_S = 0.5


@dataclass
class _Download:
    site: str
    base_bytes: int  # what the site had been served before this task
    total_bytes: int
    reported_bytes: int = 0
    reported_at: float = float("-inf")


class DownloadProgress:
    """The downloads in flight, by task id; thread-safe.

    Args:
        interval_s: Seconds between two events of one download (`PROGRESS_INTERVAL_S`).
        clock: Monotonic seconds.
    """

    def __init__(self, interval_s: float = PROGRESS_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._downloads: dict[str, _Download] = {}

    def sent(self, task_id: str, site: str, total_bytes: int, served: Mapping[str, int]) -> None:
        """A task of ``total_bytes`` of tensors was handed to ``site``; ``served`` is the service's count now."""
        if total_bytes <= 0:
            return
        with self._lock:
            self._downloads[task_id] = _Download(site, served_to(served, site), total_bytes)

    def ended(self, task_id: str) -> None:
        """The task's result arrived, or the task ended: its download is no longer followed."""
        with self._lock:
            self._downloads.pop(task_id, None)

    def poll(self, served: Mapping[str, int]) -> list[dict[str, Any]]:
        """The events due now, given the service's counts ``served``: ``{site, task_id, bytes, total}`` each.

        A download that is complete gets its last event and is dropped.
        """
        now = self._clock()
        events = []
        with self._lock:
            for task_id, download in list(self._downloads.items()):
                done = min(max(served_to(served, download.site) - download.base_bytes, 0), download.total_bytes)
                complete = done >= download.total_bytes
                if done == download.reported_bytes or (not complete and now - download.reported_at < self.interval_s):
                    continue
                download.reported_bytes, download.reported_at = done, now
                events.append({"site": download.site, "task_id": task_id, "bytes": done, "total": download.total_bytes})
                if complete:
                    del self._downloads[task_id]
        return events


def served_to(served: Mapping[str, int], site: str) -> int:
    """Bytes served to ``site``'s cells (``site`` and any ``site.<child>``)."""
    return sum(count for fqcn, count in served.items() if fqcn == site or fqcn.startswith(f"{site}."))
