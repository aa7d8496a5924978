"""Turning an outgoing envelope and body frames into wire frames, checked before any I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.cells.envelope import Envelope, encode_envelope
from engine.cells.fqcn import check_fqcn
from engine.cells.protocol import Kind, Status
from engine.errors import CellMessageTooLargeError


def new_envelope(
    kind: Kind,
    msg_id: int,
    source: str,
    target: str,
    channel: str,
    topic: str,
    header: Mapping[str, Any] | None,
    timeout_ms: int = 0,
) -> Envelope:
    """The envelope of a message this cell makes, its target, channel and topic checked.

    Raises:
        ValueError: If the target is not a cell name, or the channel or topic not a non-empty string.
    """
    check_fqcn(target, "target")
    if not (channel and topic and isinstance(channel, str) and isinstance(topic, str)):
        for key, value in (("channel", channel), ("topic", topic)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    # Positional: one is made per message.
    return Envelope(
        kind,
        msg_id,
        source,
        target,
        channel,
        topic,
        None,
        Status.OK,
        "",
        timeout_ms,
        header if header is not None else {},
    )


def frame_message(envelope: Envelope, frames: Sequence[Any], limit_bytes: int) -> list[Any]:
    """Encode the envelope and view every body frame as bytes, without copying any.

    Args:
        envelope: The message's envelope.
        frames: Body frames: objects with the buffer protocol (bytes, bytearray, memoryview,
            numpy arrays, received frames).
        limit_bytes: ``max_message_size_bytes`` of the sending cell.

    Returns:
        ``[envelope bytes, *byte views]``, ready for a zero-copy send.

    Raises:
        ValueError: If the header cannot be encoded or a frame is not contiguous.
        CellMessageTooLargeError: If envelope plus frames exceed ``limit_bytes``.
    """
    head = encode_envelope(envelope)
    wire: list[Any] = [head]
    size = len(head)
    for index, frame in enumerate(frames):
        view = frame if isinstance(frame, memoryview) else memoryview(frame)
        if not view.c_contiguous:
            raise ValueError(
                f"frame {index} of message to {envelope.target!r} (channel={envelope.channel!r}, "
                f"topic={envelope.topic!r}) is not contiguous; pass a contiguous copy "
                "(numpy.ascontiguousarray, tensor.contiguous())"
            )
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        size += view.nbytes
        wire.append(view)
    if size > limit_bytes:
        raise CellMessageTooLargeError(
            f"message to {envelope.target!r} (channel={envelope.channel!r}, topic={envelope.topic!r}) "
            f"is {size} bytes, above max_message_size_bytes={limit_bytes}; send it in chunks or raise "
            "the setting"
        )
    return wire
