"""`MessageCodec`: FOBS messages in cell frames, with their tensors moved by the downloader.

One codec per cell. It owns the registry (the caller registers its own types first) and the
streaming context, so every message this cell sends has its tensors offered for download, and
every message it receives pulls them, with the job's chunk sizes and timeouts.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from engine.errors import SerializationError
from engine.fobs import DecodeContext, EncodeContext, Registry, deserialize, serialize
from engine.streaming.folding import FoldingConsumer, TensorSink
from engine.streaming.pull import ByteBudget, ConsumerFactory, HeldDownload
from engine.streaming.via_downloader import (
    OFFERS_PROP,
    RECEIVERS_PROP,
    STREAMING_PROP,
    StreamedItem,
    StreamingContext,
    TensorViaDownloaderDecomposer,
    install_via_downloader,
)

#: ``place(peeked) -> {item: target tensor}``: see `MessageCodec.decode`.
Placement = Callable[[Any], Mapping[StreamedItem, torch.Tensor]]
#: ``fold(peeked) -> sink or None``: see `MessageCodec.decode`.
Folding = Callable[[Any], TensorSink | None]


class MessageCodec:
    """Encodes objects into cell frames and back, streaming their tensors.

    Args:
        registry: The FOBS registry (application and model types already registered); the
            codec works on a copy with the via-downloader decomposers installed, so the
            caller's registry is left as it is (register application types before).
        context: This side's cell, download service and streaming settings.

    Example:
        >>> codec = MessageCodec(registry, StreamingContext(cell, DownloadService(cell)))
        >>> frames = codec.encode(model, receivers=["site-1"])   # tensors offered to site-1
        >>> model = peer_codec.decode(frames)                    # on site-1: tensors pulled
    """

    def __init__(self, registry: Registry, context: StreamingContext) -> None:
        registry = registry.copy()
        if not isinstance(registry.for_type(torch.Tensor), TensorViaDownloaderDecomposer):
            install_via_downloader(registry)
        self._registry = registry
        self.context = context

    def encode(self, obj: Any, receivers: Sequence[str], offers: list[str] | None = None) -> list[Any]:
        """Serialize ``obj`` into frames: the FOBS header first, then its datums.

        Args:
            obj: What to send.
            receivers: The cells that will decode it, and the only ones that may pull its
                tensors (its download is released once all are done).
            offers: A list that gets the ref ids of the downloads the message offers, to wait
                for their receivers with `DownloadService.wait_finished`.
        """
        props: dict[str, Any] = {STREAMING_PROP: self.context, RECEIVERS_PROP: list(receivers)}
        if offers is not None:
            props[OFFERS_PROP] = offers
        header, frames = serialize(obj, EncodeContext(props=props), self._registry)
        return [header, *frames]

    def decode(
        self,
        frames: Sequence[Any],
        consumer_factory: ConsumerFactory | None = None,
        *,
        sender: str | None = None,
        max_bytes: int | None = None,
        what: str = "the message",
        place: Placement | None = None,
        fold: Folding | None = None,
        held: list[HeldDownload] | None = None,
        stop: threading.Event | None = None,
    ) -> Any:
        """Rebuild an object from received frames, pulling its streamed tensors first.

        Args:
            frames: The frames of a message made by `encode`.
            consumer_factory: Where this message's tensors land; the context's by default.
            sender: The cell the message came from (``message.source``, authenticated by the
                cells layer): its references must name it as their owner, so that the message
                cannot make this side pull from a third cell. None: not checked.
            max_bytes: Bytes the message's streams may announce together; a bigger one is
                refused before anything is reserved. None: no bound.
            what: What the message is, for the refusal (``"a result of site-1"``).
            place: Puts streamed tensors into tensors of the receiver's own. It is called with
                the message rebuilt before anything is pulled (every streamed or inline tensor
                and array a `StreamedItem`) and returns target tensors by the items they stand
                for; those land straight in the targets when all of them fit (see
                `MemoryConsumer`) and the rebuilt message holds the targets in their places;
                otherwise everything lands in new memory as without ``place``. None: no peek.
            fold: Hands streamed tensors on one at a time instead (a server folding results
                into a sum): called with the message rebuilt before anything is pulled, as
                ``place``; when it returns a `TensorSink`, the message's streamed torch tensors
                go to it through a `FoldingConsumer` (each once complete; the rebuilt message
                holds meta tensors in their places), else the message is received as without.
            held: Gets ``(sender, ref)`` of each tensor download instead of the sender being
                told it is complete, so the same frames can be decoded (pulled) again, e.g.
                into a new sum; `engine.streaming.pull.release_held` lets the sender free
                them. None: the sender is told at once.
            stop: Set when this side no longer wants the message (its round or the job
                ended): its downloads end at once with a `StreamingError`. None: they run to
                their end.
        """
        if not frames:
            raise SerializationError("an empty message: expected a FOBS header frame")
        context = self.context
        changes: dict[str, Any] = {}
        if place is not None or fold is not None:
            # The peek lists the message's downloads in ``held`` too: a result refused at its
            # header is never pulled, and `release_held` then frees it on its sender at once.
            peek = replace(context, peek=True, held=held, **({"sender": sender} if sender is not None else {}))
            peeked = deserialize(frames[0], frames[1:], DecodeContext(props={STREAMING_PROP: peek}), self._registry)
            sink = fold(peeked) if fold is not None else None
            if sink is not None:
                changes["tensor_consumer"] = functools.partial(FoldingConsumer, sink=sink)
            elif place is not None:
                targets = {item.item: tensor for item, tensor in place(peeked).items() if item.is_tensor}
                if targets:
                    changes["targets"] = targets
            del peeked
        if consumer_factory is not None:
            changes["consumer_factory"] = consumer_factory
        if sender is not None:
            changes["sender"] = sender
        if max_bytes is not None:
            changes["budget"] = ByteBudget(max_bytes, what)
        if held is not None:
            changes["held"] = held
        if stop is not None:
            changes["stop"] = stop
        if changes:
            context = replace(context, **changes)
        return deserialize(frames[0], frames[1:], DecodeContext(props={STREAMING_PROP: context}), self._registry)
