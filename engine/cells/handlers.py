"""Which function handles which (channel, topic): an explicit registry that refuses mistakes."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.cells.message import Message, Reply
from engine.cells.protocol import ANY_TOPIC

Handler = Callable[[Message], "Reply | None"]
"""A handler gets the message and returns a :class:`Reply`, or None for an empty ok reply.

The return value of a handler for a fire-and-forget message is ignored. A handler that raises
makes the cell answer the request with status error; the cell keeps serving.
"""


class HandlerRegistry:
    """Handlers by (channel, topic); ``topic="*"`` catches the channel's other topics.

    Registration may happen from any thread, before or after the cell starts; lookups are
    lock-free (the table is replaced, never mutated in place).

    Example:
        >>> registry = HandlerRegistry()
        >>> registry.register("task", "get", lambda message: None)
        >>> registry.find("task", "get") is not None
        True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[tuple[str, str], Handler] = {}

    def register(self, channel: str, topic: str, handler: Handler) -> None:
        """Register ``handler`` for ``(channel, topic)``.

        Raises:
            ValueError: If channel or topic is not a non-empty string, or the pair already has
                a handler.
            TypeError: If ``handler`` is not callable.
        """
        for key, value in (("channel", channel), ("topic", topic)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key} must be a non-empty string, got {value!r}")
        if not callable(handler):
            raise TypeError(f"handler for channel={channel!r} topic={topic!r} is not callable")
        with self._lock:
            if (channel, topic) in self._table:
                raise ValueError(
                    f"a handler for channel={channel!r} topic={topic!r} is already registered; "
                    "call unregister first to replace it"
                )
            table = dict(self._table)
            table[(channel, topic)] = handler
            self._table = table

    def unregister(self, channel: str, topic: str) -> None:
        """Remove the handler of ``(channel, topic)``; a missing one raises KeyError."""
        with self._lock:
            table = dict(self._table)
            try:
                del table[(channel, topic)]
            except KeyError:
                raise KeyError(f"no handler for channel={channel!r} topic={topic!r}") from None
            self._table = table

    def find(self, channel: str, topic: str) -> Handler | None:
        """Return the handler for the pair, else the channel's ``"*"`` handler, else None."""
        table = self._table
        handler = table.get((channel, topic))
        if handler is None:
            handler = table.get((channel, ANY_TOPIC))
        return handler
