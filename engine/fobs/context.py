"""Per-message state that decomposers share while one message is encoded or decoded."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import MalformedMessageError
from engine.fobs.datum import Datum


@dataclass
class EncodeContext:
    """State of one message being serialized.

    Attributes:
        props: Settings of the sending side (e.g. chunk sizes, a download service), read-only.
        datums: Buffers collected so far; datum ``i`` becomes frame ``i`` of the message.
        state: Scratch space for decomposers, e.g. tensors collected across the message.
    """

    props: Mapping[str, Any] = field(default_factory=dict)
    datums: list[Datum] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    _post_callbacks: dict[str, Callable[[EncodeContext], None]] = field(default_factory=dict)

    def add_datum(self, datum: Datum) -> int:
        """Add a buffer to the message; return its frame index."""
        self.datums.append(datum)
        return len(self.datums) - 1

    def add_post_callback(self, key: str, callback: Callable[[EncodeContext], None]) -> None:
        """Run ``callback`` once after the whole message is decomposed (once per ``key``).

        A decomposer that gathers objects across a message (all tensors into one download)
        uses this to add its datum at the end.
        """
        self._post_callbacks.setdefault(key, callback)

    def run_post_callbacks(self) -> None:
        """Run the registered post-callbacks in registration order."""
        for callback in self._post_callbacks.values():
            callback(self)


@dataclass
class DecodeContext:
    """State of one message being deserialized.

    Attributes:
        props: Settings of the receiving side (e.g. ``download_to_disk``), read-only.
        frames: The message's datum frames, as received (never joined or copied).
        dots: The datum object type of each frame.
        state: Scratch space for datum handlers and decomposers (e.g. downloaded tensors).
        depth: Nesting depth of decomposed objects being rebuilt right now.
    """

    props: Mapping[str, Any] = field(default_factory=dict)
    frames: Sequence[Any] = ()
    dots: Sequence[int] = ()
    state: dict[str, Any] = field(default_factory=dict)
    depth: int = 0

    def frame(self, index: Any) -> memoryview:
        """Return datum frame ``index`` as a memoryview; a bad index is a malformed message."""
        if type(index) is not int or not 0 <= index < len(self.frames):
            raise MalformedMessageError(
                f"datum reference {index!r} is not one of the message's {len(self.frames)} frames"
            )
        return memoryview(self.frames[index])
