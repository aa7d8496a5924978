"""Via-downloader decomposers: the tensors (arrays) of a message travel by download, not inline.

Installed with `install_via_downloader` in place of FOBS's native tensor and array decomposers.
While a message is serialized, every tensor is replaced by a small reference and gathered; once
the whole message is decomposed, all of them are offered as one downloadable (produced once,
pulled by every receiver) and a reference datum is added to the message. The receiving side
pulls the stream before the message is rebuilt and puts each tensor back in its place. Which
messages stream, and in what chunks, comes from the `StreamingContext` in the FOBS context's
props; without one, or with a chunk size of 0, tensors travel inline as before. When the
context's consumers download to disk (`engine.streaming.disk`), each tensor is put back as a
`LazyRef` to the downloaded file instead, read only when resolved.

A receiver that wants some tensors in memory of its own (a training script's parameters) decodes
a message twice (`engine.streaming.codec.MessageCodec.decode` with ``place``): first a *peek*
(``StreamingContext.peek``) that pulls nothing and puts a `StreamedItem` where each streamed
value would be, to see which tensor stands where; then for real, with ``targets`` naming the
tensors the stream's entries land in.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from engine.cells import Cell
from engine.cells.retry import DEFAULT_RETRIES, DEFAULT_RETRY_BACKOFF_S, RetryPolicy
from engine.errors import SerializationError, StreamingError
from engine.fobs import Datum, DatumType, DecodeContext, EncodeContext, Registry
from engine.fobs.arrays import NumpyArrayDecomposer, TensorDecomposer
from engine.fobs.dtypes import is_supported
from engine.fobs.quantized import QuantizedTensor
from engine.streaming.consumers import MemoryConsumer
from engine.streaming.lazy import LazyRef, LazyTensorDict
from engine.streaming.pull import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MIN_THROUGHPUT,
    ByteBudget,
    ConsumerFactory,
    HeldDownload,
    download_tensors,
)
from engine.streaming.service import DownloadService

#: Key of the `StreamingContext` in ``EncodeContext.props`` / ``DecodeContext.props``.
STREAMING_PROP = "streaming"
#: Key of the message's receivers (FQCNs) in ``EncodeContext.props``.
RECEIVERS_PROP = "receivers"
#: Key of a list in ``EncodeContext.props`` that collects the ref ids of the message's offers.
OFFERS_PROP = "offers"
#: Defaults of the job config's streaming settings (as in ``schemas/common.schema.json``).
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
DEFAULT_PER_REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class StreamingContext:
    """What the via-downloader (and file-based) decomposers need from the cell that sends or receives.

    Attributes:
        cell: This side's cell.
        service: The download service that serves this side's tensors (needed to send).
        tensor_chunk_bytes: Chunk size for torch tensors (and files), in bytes; 0 sends tensors inline.
        array_chunk_bytes: Chunk size for numpy arrays, in bytes; 0 sends them inline.
        per_request_timeout_s: Longest wait for one chunk request when receiving.
        transaction_timeout_s: Seconds without requests after which an offer is dropped; None
            (the default) means ``per_request_timeout_s`` plus the waits of all of ``retry``'s
            retries: a receiver silent for longer than one request and its retries may take
            is gone.
        consumer_factory: Where received chunks land (tensors in memory by default).
        max_in_flight: Chunk requests a receiver keeps outstanding at once (>= 1).
        min_throughput: Bytes per second a received stream must keep up on average (see
            `download_tensors`); 0: no bound beyond the per-request timeout.
        retry: How a chunk request lost to a timeout or a dropped connection is asked again
            (``streaming_retries``, ``streaming_retry_backoff_s``).
        sender: When receiving one message: the cell it came from, as the cells layer
            authenticated it. Its references must name that cell as the owner of their data, so
            a message cannot make the receiver pull from a third cell. None: not checked.
        budget: When receiving one message: the bytes its downloads may announce together.
        peek: When receiving one message: pull nothing, and rebuild every streamed (or inline)
            tensor and array as a `StreamedItem` placeholder, to see where each one stands.
        targets: When receiving one message: tensors of the receiver's own that streamed
            tensors land in, by the item key of their `StreamedItem` (see `MemoryConsumer`).
        tensor_consumer: When receiving one message: where its streamed torch tensors land
            instead of ``consumer_factory`` (a `FoldingConsumer` that folds them into a sum).
        held: When receiving one message: its tensor downloads are not reported done to the
            sender but listed here, so the message can be decoded (pulled) again; see
            `engine.streaming.pull.release_held`.
        stop: When receiving one message: set when the receiver no longer wants it (the round
            or the job ended); its downloads then end at once. None: they run to their end.
    """

    cell: Cell
    service: DownloadService | None = None
    tensor_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    array_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    per_request_timeout_s: float = DEFAULT_PER_REQUEST_TIMEOUT_S
    transaction_timeout_s: float | None = None  # None: resolved to per_request_timeout_s
    consumer_factory: ConsumerFactory = MemoryConsumer
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    min_throughput: int = DEFAULT_MIN_THROUGHPUT
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    sender: str | None = None
    budget: ByteBudget | None = None
    peek: bool = False
    targets: Mapping[str, torch.Tensor] = field(default_factory=dict, compare=False)
    tensor_consumer: ConsumerFactory | None = field(default=None, compare=False)
    held: list[HeldDownload] | None = field(default=None, compare=False)
    stop: threading.Event | None = field(default=None, compare=False)

    @property
    def sending_service(self) -> DownloadService:
        """``service``, which a side that offers tensors to its peers has.

        Raises:
            RuntimeError: This side has none (it only receives).
        """
        if self.service is None:
            raise RuntimeError("this side has no download service: it only receives")
        return self.service

    def __post_init__(self) -> None:
        if self.transaction_timeout_s is None:
            object.__setattr__(self, "transaction_timeout_s", self.per_request_timeout_s + self.retry.window_s())

    @classmethod
    def from_config(
        cls,
        cell: Cell,
        service: DownloadService | None,
        config: Mapping[str, Any],
        consumer_factory: ConsumerFactory = MemoryConsumer,
    ) -> StreamingContext:
        """Build the context from a validated job config (``config_fed_server`` / ``config_fed_client``).

        Reads ``tensor_download_chunk_size``, ``np_download_chunk_size``,
        ``streaming_per_request_timeout``, ``streaming_max_requests_in_flight``,
        ``streaming_min_throughput``, ``streaming_retries`` and ``streaming_retry_backoff_s``;
        an absent key takes its schema default. Other keys are ignored.

        Args:
            cell: This side's cell.
            service: This side's download service (None on a side that only receives).
            config: The config's top-level settings (a dict of the parsed file).
            consumer_factory: Where received tensors land.

        Raises:
            StreamingError: A setting has the wrong type or range (the config was not validated);
                the message names the key and the value.

        Example:
            >>> context = StreamingContext.from_config(cell, DownloadService(cell), job.server.data)
        """
        return cls(
            cell,
            service,
            tensor_chunk_bytes=_setting(config, "tensor_download_chunk_size", DEFAULT_CHUNK_BYTES, minimum=0),
            array_chunk_bytes=_setting(config, "np_download_chunk_size", DEFAULT_CHUNK_BYTES, minimum=0),
            per_request_timeout_s=_timeout_setting(config, "streaming_per_request_timeout"),
            consumer_factory=consumer_factory,
            max_in_flight=_setting(config, "streaming_max_requests_in_flight", DEFAULT_MAX_IN_FLIGHT, minimum=1),
            min_throughput=_setting(config, "streaming_min_throughput", DEFAULT_MIN_THROUGHPUT, minimum=0),
            retry=retry_policy_of(config),
        )


@dataclass(frozen=True)
class StreamedItem:
    """Where a streamed value stands in a message decoded with ``peek``: nothing is pulled yet.

    Attributes:
        kind: ``"tensors"`` or ``"arrays"`` (the download it comes by), ``"inline"`` for a
            value that travels in the message itself, ``"file"`` for an object of a file-based
            decomposer (only ``"tensors"`` items can be placed).
        item: Its key in that download's stream (``""`` for inline values).
        as_numpy: It comes back as a numpy array (a quantized array travels in the tensors'
            download).
    """

    kind: str
    item: str = ""
    as_numpy: bool = False

    @property
    def is_tensor(self) -> bool:
        """Whether it streams as a torch tensor: what a fold, or a script's own tensors, can take."""
        return self.kind == "tensors" and not self.as_numpy


#: The placeholder of a tensor or array that travels inline (chunk size 0).
INLINE_ITEM = StreamedItem("inline")


def check_owner(context: StreamingContext, owner: object, what: str) -> None:
    """Refuse a reference whose data is not its message's sender's (see `StreamingContext.sender`)."""
    if context.sender is not None and owner != context.sender:
        raise SerializationError(
            f"a message from {context.sender!r} names {owner!r} as the owner of its {what}; refused: a message "
            "may offer only its sender's own data"
        )


def retry_policy_of(config: Mapping[str, Any]) -> RetryPolicy:
    """The `RetryPolicy` of a config's ``streaming_retries`` and ``streaming_retry_backoff_s`` (absent: defaults).

    Raises:
        StreamingError: A value of the wrong type or range; the message names the key, the value
            and what it must be.
    """
    retries = _setting(config, "streaming_retries", DEFAULT_RETRIES, minimum=0)
    return RetryPolicy(retries, _timeout_setting(config, "streaming_retry_backoff_s", DEFAULT_RETRY_BACKOFF_S))


def _setting(config: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = config.get(key, default)
    if type(value) is not int or value < minimum:
        raise StreamingError(f"{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _timeout_setting(config: Mapping[str, Any], key: str, default: float = DEFAULT_PER_REQUEST_TIMEOUT_S) -> float:
    value = config.get(key, default)
    if type(value) not in (int, float) or not value > 0:
        raise StreamingError(f"{key}: expected seconds > 0, got {value!r}")
    return float(value)


class _ViaDownloader(ABC):
    """What the tensor and array versions share: gather, offer once, pull, put back."""

    kind: str  # "tensors" or "arrays"
    dot: DatumType

    @abstractmethod
    def chunk_bytes(self, context: StreamingContext) -> int:
        """The chunk size setting of this kind of value (0 = inline)."""

    def gather(self, value: torch.Tensor, ctx: EncodeContext) -> dict[str, Any] | None:
        """Take ``value`` into the message's downloadable; None when it must travel inline."""
        context = ctx.props.get(STREAMING_PROP)
        if context is None or self.chunk_bytes(context) == 0 or context.service is None:
            return None
        gathered = ctx.state.setdefault(self.kind, {})
        key = str(len(gathered))
        gathered[key] = value
        ctx.add_post_callback(self.kind, self._offer)
        return {"item": key}

    def _offer(self, ctx: EncodeContext) -> None:
        context: StreamingContext = ctx.props[STREAMING_PROP]
        receivers: Sequence[str] | None = ctx.props.get(RECEIVERS_PROP)
        ref = context.service.add_tensors(
            ctx.state[self.kind], self.chunk_bytes(context), receivers, context.transaction_timeout_s
        )
        offers = ctx.props.get(OFFERS_PROP)
        if offers is not None:
            offers.append(ref)
        reference = msgpack.packb({"ref": ref, "owner": context.cell.fqcn})
        ctx.add_datum(Datum(reference, self.dot))

    def pull(self, ctx: DecodeContext, index: int) -> None:
        """Datum handler: download the stream a reference datum names, before objects are rebuilt."""
        context = ctx.props.get(STREAMING_PROP)
        if context is None:
            raise SerializationError(f"the message streams its {self.kind}, but this side has no streaming context")
        try:
            reference = msgpack.unpackb(bytes(ctx.frame(index)))
            ref, owner = reference["ref"], reference["owner"]
        except (ValueError, KeyError, TypeError) as e:
            raise SerializationError(f"malformed reference to streamed {self.kind}: {e}") from e
        check_owner(context, owner, self.kind)
        if context.peek:
            if context.held is not None:  # never pulled if refused now: its sender may be told so
                context.held.append((owner, ref))
            ctx.state[self.kind] = _PEEKED
            return
        consumer_factory = context.consumer_factory
        if context.tensor_consumer is not None and self.kind == "tensors":
            consumer_factory = context.tensor_consumer
        elif context.targets and self.kind == "tensors":
            # The receiver's own tensors, in memory whatever the context's consumers do otherwise.
            consumer_factory = functools.partial(MemoryConsumer, targets=context.targets)
        ctx.state[self.kind] = download_tensors(
            context.cell,
            owner,
            ref,
            context.per_request_timeout_s,
            consumer_factory,
            context.max_in_flight,
            context.budget,
            context.min_throughput,
            context.held,
            context.retry,
            context.stop,
        )

    def lookup(self, data: Any, ctx: DecodeContext, as_numpy: bool = False) -> torch.Tensor | LazyRef:
        """The downloaded tensor a reference stands for, or a `LazyRef` when it went to disk."""
        try:
            downloaded = ctx.state[self.kind]
            if downloaded is _PEEKED:
                return StreamedItem(self.kind, str(data["item"]), as_numpy)
            if isinstance(downloaded, LazyTensorDict):
                return downloaded.make_lazy_ref(data["item"], as_numpy=as_numpy)
            return downloaded[data["item"]]
        except (KeyError, TypeError) as e:
            raise SerializationError(f"a streamed reference {data!r} names none of the downloaded {self.kind}") from e


class TensorViaDownloaderDecomposer(_ViaDownloader, TensorDecomposer):
    """torch tensors by download (``tensor_download_chunk_size``), or inline when it is 0."""

    kind = "tensors"
    dot = DatumType.TENSOR_REF

    def chunk_bytes(self, context: StreamingContext) -> int:
        return context.tensor_chunk_bytes

    def wire_name(self) -> str:
        return "flengine.Tensor"

    def decompose(self, obj: torch.Tensor, ctx: EncodeContext) -> Any:
        return self.gather(obj, ctx) or {"inline": super().decompose(obj, ctx)}

    def recompose(self, data: Any, ctx: DecodeContext) -> torch.Tensor | LazyRef | StreamedItem:
        if isinstance(data, dict) and "inline" in data:
            return INLINE_ITEM if _peeking(ctx) else super().recompose(data["inline"], ctx)
        return self.lookup(data, ctx)


class QuantizedViaDownloaderDecomposer(TensorViaDownloaderDecomposer):
    """A `QuantizedTensor` in the message's tensor download, as its wire records.

    The receiver gets the values back in the tensor's own dtype and shape (a numpy array when the
    value was one): `engine.streaming.dequantize` decodes the records as the chunks land. Inline
    (no streaming, or a chunk size of 0) the tensor travels as it is, unquantized.
    """

    covers_subclasses = False

    def supported_type(self) -> type[QuantizedTensor]:
        return QuantizedTensor

    def wire_name(self) -> str:
        return "flengine.QuantizedTensor"

    def decompose(self, obj: QuantizedTensor, ctx: EncodeContext) -> Any:
        gathered = self.gather(obj, ctx)
        if gathered is None:
            gathered = {"inline": TensorDecomposer.decompose(self, obj.tensor, ctx)}
        return {**gathered, "numpy": obj.as_numpy}

    def recompose(self, data: Any, ctx: DecodeContext) -> torch.Tensor | np.ndarray | LazyRef | StreamedItem:
        as_numpy = isinstance(data, dict) and data.get("numpy") is True
        if isinstance(data, dict) and "inline" in data:
            if _peeking(ctx):
                return INLINE_ITEM
            value = TensorDecomposer.recompose(self, data["inline"], ctx)
        else:
            value = self.lookup(data, ctx, as_numpy=as_numpy)
        return value.numpy() if as_numpy and isinstance(value, torch.Tensor) else value


class ArrayViaDownloaderDecomposer(_ViaDownloader, NumpyArrayDecomposer):
    """numpy arrays by download (``np_download_chunk_size``), or inline when it is 0.

    Arrays whose dtype torch cannot hold (strings, say) always travel inline.
    """

    kind = "arrays"
    dot = DatumType.ARRAY_REF

    def chunk_bytes(self, context: StreamingContext) -> int:
        return context.array_chunk_bytes

    def wire_name(self) -> str:
        return "flengine.ndarray"

    def decompose(self, obj: np.ndarray, ctx: EncodeContext) -> Any:
        tensor = _as_tensor(obj)
        gathered = self.gather(tensor, ctx) if tensor is not None else None
        return gathered or {"inline": super().decompose(obj, ctx)}

    def recompose(self, data: Any, ctx: DecodeContext) -> np.ndarray | LazyRef | StreamedItem:
        if isinstance(data, dict) and "inline" in data:
            return INLINE_ITEM if _peeking(ctx) else super().recompose(data["inline"], ctx)
        value = self.lookup(data, ctx, as_numpy=True)
        return value if isinstance(value, (LazyRef, StreamedItem)) else value.numpy()


#: What a peeking pull leaves in the decode state instead of the downloaded tensors.
_PEEKED = object()


def _peeking(ctx: DecodeContext) -> bool:
    context = ctx.props.get(STREAMING_PROP)
    return context is not None and context.peek


def install_via_downloader(registry: Registry) -> None:
    """Make ``registry`` send tensors and arrays by download when a message's context says so.

    Replaces the native tensor and array decomposers and registers the datum handlers that pull
    the streams. Both sides of a connection must install it.
    """
    for decomposer in (TensorViaDownloaderDecomposer(), ArrayViaDownloaderDecomposer()):
        registry.replace(decomposer)
        registry.register_datum_handler(decomposer.dot, decomposer.pull)
    quantized = QuantizedViaDownloaderDecomposer()  # its records come by the tensors' download
    if quantized.wire_name() not in registry.wire_names():
        registry.register(quantized)


def _as_tensor(array: np.ndarray) -> torch.Tensor | None:
    """A tensor sharing the array's memory, or None when torch (or safetensors) cannot hold it."""
    try:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    except (TypeError, ValueError):  # a dtype torch lacks, or a non-native byte order
        return None
    return tensor if is_supported(tensor.dtype) else None
