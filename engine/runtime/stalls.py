"""`StallWatch`: which sites keep leaving their task data unpulled, round after round.

In memory mode a submitted result is folded only once the sites have pulled the task's model
(so the server never holds that model and a growing sum at once). A site that never pulls would
make every round wait for it; instead the server waits at most ``fold_wait_s`` for receivers
that have not asked for a single chunk, then drops them as receivers of the task's offers (the
model is freed as soon as the sites that did pull are done) and tells this watch. A site dropped
``STALLED_AFTER`` tasks in a row is *stalled*: named in an event, and in the ``stalled`` of every
round it stays so (until it pulls a task again).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

#: Tasks in a row a site left unpulled before it is reported stalled.
STALLED_AFTER = 3
#: Seconds a submitted result waits, by default, for receivers that never asked for the task data.
DEFAULT_FOLD_WAIT_S = 2.0


class StallWatch:
    """Counts, per site, the tasks in a row whose data it never pulled (thread-safe).

    Args:
        stalled_after: Tasks in a row after which a site counts as stalled.

    Example:
        >>> watch = StallWatch(stalled_after=2)
        >>> watch.judged(("ref-1",), receivers={"site-1", "site-2"}, skipped={"site-2"})
        []
        >>> watch.judged(("ref-2",), receivers={"site-1", "site-2"}, skipped={"site-2"})
        ['site-2']
        >>> watch.stalled()
        ['site-2']
    """

    def __init__(self, stalled_after: int = STALLED_AFTER) -> None:
        if isinstance(stalled_after, bool) or not isinstance(stalled_after, int) or stalled_after < 1:
            raise ValueError(f"stalled_after: expected an integer >= 1, got {stalled_after!r}")
        self._stalled_after = stalled_after
        self._lock = threading.Lock()
        self._in_a_row: dict[str, int] = {}
        self._judged: set[tuple[str, ...]] = set()

    def judged(self, offers: Iterable[str], receivers: Iterable[str], skipped: Iterable[str]) -> list[str]:
        """Record one task's offers: ``skipped`` never pulled them, the other ``receivers`` did.

        A task is counted once, however many results wait on it. Returns the sites that have
        just become stalled (their count reached ``stalled_after`` with this task).
        """
        key = tuple(sorted(offers))
        skipped = set(skipped)
        with self._lock:
            if key in self._judged:
                return []
            self._judged.add(key)
            for site in set(receivers) - skipped:
                self._in_a_row.pop(site, None)
            newly = []
            for site in sorted(skipped):
                self._in_a_row[site] = self._in_a_row.get(site, 0) + 1
                if self._in_a_row[site] == self._stalled_after:
                    newly.append(site)
            return newly

    def pulled(self, site: str) -> None:
        """``site`` pulled a task's data: it is not stalled any more."""
        with self._lock:
            self._in_a_row.pop(site, None)

    def stalled(self) -> list[str]:
        """The sites stalled now, sorted."""
        with self._lock:
            return sorted(site for site, n in self._in_a_row.items() if n >= self._stalled_after)
