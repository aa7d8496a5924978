"""Running one handler, on a pool thread or inline on the I/O thread, and turning its outcome into its reply."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.cells.envelope import Envelope, encode_envelope
from engine.cells.framing import frame_message
from engine.cells.handlers import Handler
from engine.cells.message import Message, Reply
from engine.cells.protocol import WIRE_STATUSES, Kind, Status
from engine.errors import CellMessageTooLargeError

logger = logging.getLogger(__name__)


def run_handler(
    handler: Handler,
    message: Message,
    *,
    next_id: Callable[[], int],
    limit_bytes: int,
    count: Callable[[str], None],
) -> tuple[Envelope, list[Any]] | None:
    """Call ``handler`` and build the reply to a request; None for a fire-and-forget message.

    A handler that raises, returns something other than a Reply or None, or returns a reply
    that cannot be sent (too large, unencodable header) yields an error reply that says so; the
    exception is logged here and never reaches the pool.

    Args:
        handler: The registered handler.
        message: The received message.
        next_id: Returns a fresh message id for the reply.
        limit_bytes: ``max_message_size_bytes`` of the replying cell.
        count: Adds one to a named counter of the cell.

    Returns:
        The reply's envelope and wire frames, or None when nothing is to be sent.
    """
    request = message.envelope
    me = request.target
    try:
        result = handler(message)
    except Exception as e:
        count("handler_errors")
        where = _where(request)
        logger.exception("handler raised: cell=%s %s from=%s", me, where, request.source)
        result = Reply(status=Status.ERROR, reason=f"{me}: handler for {where} raised {type(e).__name__}: {e}")
    if request.kind is not Kind.REQUEST:
        return None
    if result is None:
        result = _EMPTY_REPLY
    elif not isinstance(result, Reply) or result.status not in WIRE_STATUSES:
        result = Reply(
            status=Status.ERROR,
            reason=f"{me}: handler for {_where(request)} returned {result!r}; return a Reply (status ok, error, "
            "timeout or unreachable) or None",
        )
    answer = request.reply(next_id(), result.status, result.reason, result.header)
    try:
        return answer, frame_message(answer, result.frames, limit_bytes)
    except (ValueError, CellMessageTooLargeError) as e:
        where = _where(request)
        logger.error("handler reply refused: cell=%s %s error=%s", me, where, e)
        failure = request.reply(next_id(), Status.ERROR, f"{me}: reply of handler for {where} refused: {e}")
        return failure, [encode_envelope(failure)]


_EMPTY_REPLY = Reply()  # what a handler returning None answers (read only)


def _where(request: Envelope) -> str:
    return f"channel={request.channel!r} topic={request.topic!r}"


class InlineHandler:
    """Marks a handler registered with ``inline``: the I/O thread runs it itself when ``runs_inline`` says so."""

    def __init__(self, handler: Handler, runs_inline: Callable[[Message], bool]) -> None:
        for name, value in (("handler", handler), ("inline", runs_inline)):
            if not callable(value):
                raise TypeError(f"{name} {value!r} is not callable")
        self.handler = handler
        self._runs_inline = runs_inline

    def runs_inline(self, message: Message) -> bool:
        """Whether to run on the I/O thread; a predicate that raises sends the message to the pool."""
        try:
            return bool(self._runs_inline(message))
        except Exception:
            logger.exception("inline predicate raised; running the handler on the pool: topic=%s", message.topic)
            return False

    def __call__(self, message: Message) -> Reply | None:
        return self.handler(message)


def always_inline(message: Message) -> bool:
    """The predicate of a handler registered with ``inline=True``: every message runs inline."""
    return True
