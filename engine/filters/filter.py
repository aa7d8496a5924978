"""`Filter`: changes task data before it leaves, or a result before it is used."""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.model import Shareable


class Filter(ABC):
    """Transforms a `Shareable` on its way between the server and a client.

    Task data filters run on the server before a task is sent and on the client before the
    executor sees it; result filters run on the client before a result is sent and on the
    server before the workflow sees it. A filter returns the shareable to pass on (the one it
    got, changed, or a new one).

    Example:
        A filter that tags each shareable with the site it passes::

            class TagSite(Filter):
                def process(self, shareable: Shareable, site: str) -> Shareable:
                    shareable.set_header("filtered_for", site)
                    return shareable
    """

    #: True when `process` gives the same result whatever the site (it ignores ``site`` and
    #: draws nothing at random): the server then filters a task once and serves one download
    #: to all its clients, instead of filtering and encoding it once per client.
    same_for_every_site: bool = False

    @abstractmethod
    def process(self, shareable: Shareable, site: str) -> Shareable:
        """Return ``shareable`` filtered.

        Args:
            shareable: The task data or result.
            site: The client's name (e.g. ``"site-1"``), on the server and on the client alike.
        """
