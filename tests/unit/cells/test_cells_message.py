"""Message status -> exception mapping."""

from __future__ import annotations

import pytest

from engine.cells.envelope import Envelope
from engine.cells.message import Message
from engine.cells.protocol import Kind, Status
from engine.errors import (
    CellClosedError,
    CellError,
    CellRemoteError,
    CellTimeoutError,
    CellUnreachableError,
)


def _reply(status: Status) -> Message:
    return Message(
        Envelope(Kind.REPLY, 1, "site-2", "site-1", "task", "get", reply_to=7, status=status, reason="because"),
        (memoryview(b"ab"), memoryview(b"cde")),
    )


def test_ok_returns_itself() -> None:
    message = _reply(Status.OK)

    assert message.raise_for_status() is message
    assert message.ok and message.body_bytes == 5


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (Status.ERROR, CellRemoteError),
        (Status.TIMEOUT, CellTimeoutError),
        (Status.UNREACHABLE, CellUnreachableError),
        (Status.CLOSED, CellClosedError),
    ],
    ids=lambda v: getattr(v, "value", getattr(v, "__name__", "")),
)
def test_failure_raises_matching_error_naming_target_channel_topic(status: Status, error: type[CellError]) -> None:
    with pytest.raises(
        error,
        match=rf"'site-2' \(channel='task', topic='get'\).*"
        rf"{status.value}: because",
    ):
        _reply(status).raise_for_status()
