"""Pulling a download from its sender in chunks: the receiver's side of `engine.streaming.service`.

`download_tensors` / `download_file` ask for the info, refuse a stream of the other kind, then
keep several chunk requests in flight, each bounded by the per-request timeout, and hand every
chunk to a consumer as it lands (`engine.streaming.chunks`: a request lost to a timeout or a
dropped connection is asked again, as a `RetryPolicy` says, for the missing chunk only);
`ByteBudget` bounds what one message's downloads may announce; a download pulled with ``held``
is reported done later (`release_held`), so it can be pulled again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from engine.cells import Cell, Message
from engine.cells.retry import NO_RETRY, RetryPolicy, request_with_retries
from engine.errors import AnnouncementRefused, CellError, StreamingError
from engine.streaming.chunks import ChunkPuller
from engine.streaming.consumers import ChunkConsumer, FileConsumer, MemoryConsumer, StreamConsumer
from engine.streaming.dequantize import DequantizingConsumer, plan_of
from engine.streaming.downloadable import KIND_FILE, KIND_TENSORS
from engine.streaming.layout import StreamLayout
from engine.streaming.service import CHANNEL, TOPIC_DONE, TOPIC_INFO

log = logging.getLogger(__name__)

#: Chunk requests a receiver keeps in flight so the pipe never idles.
DEFAULT_MAX_IN_FLIGHT = 4
#: Bytes per second a download must keep up on average by default (``streaming_min_throughput``).
DEFAULT_MIN_THROUGHPUT = 256 << 10

ConsumerFactory = Callable[[StreamLayout, int], StreamConsumer]
#: ``(sender, ref)`` of a download whose completion is not reported yet (see `download_tensors`).
HeldDownload = tuple[str, str]


class ByteBudget:
    """How many bytes the downloads of one message may still announce (shared by them, thread-safe).

    A receiver that knows what to expect (a result answers a model of known size) gives the
    message a budget: a sender that announces more is refused before a byte of memory or disk is
    reserved for it.

    Args:
        limit_bytes: Bytes all the message's downloads may announce together (>= 0).
        what: What the budget is for, in messages (``"a result of site-1"``).
    """

    def __init__(self, limit_bytes: int, what: str) -> None:
        if type(limit_bytes) is not int or limit_bytes < 0:
            raise ValueError(f"limit_bytes must be an integer >= 0, got {limit_bytes!r}")
        self.left_bytes = limit_bytes
        self.limit_bytes = limit_bytes
        self.what = what
        self._lock = threading.Lock()

    #: The smallest chunk a sender may cut a budgeted stream into (tiny chunks would turn one
    #: result into millions of requests and bookkeeping entries).
    min_chunk_bytes = 4096

    def take(self, nbytes: int, where: str, chunk_bytes: int | None = None) -> None:
        """Reserve ``nbytes`` of the budget, or raise `StreamingError` (nothing taken) when it does not fit.

        Args:
            nbytes: Bytes the stream announces.
            where: The download, for the message.
            chunk_bytes: The stream's chunk size; one below `min_chunk_bytes` is refused for a
                stream larger than one chunk.
        """
        if chunk_bytes is not None and chunk_bytes < self.min_chunk_bytes and nbytes > chunk_bytes:
            raise AnnouncementRefused(
                f"{where}: the sender cut {nbytes} bytes into chunks of {chunk_bytes} bytes; "
                f"{self.what} must come in chunks of at least {self.min_chunk_bytes} bytes"
            )
        with self._lock:
            if nbytes > self.left_bytes:
                raise AnnouncementRefused(
                    f"{where}: the sender announced {nbytes} bytes, more than {self.what} may hold "
                    f"({self.limit_bytes} bytes in all, {self.left_bytes} left); refused before anything was reserved"
                )
            self.left_bytes -= nbytes


def download_tensors(
    cell: Cell,
    source: str,
    ref: str,
    per_request_timeout_s: float,
    consumer_factory: ConsumerFactory = MemoryConsumer,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    budget: ByteBudget | None = None,
    min_throughput: int = 0,
    held: list[HeldDownload] | None = None,
    retry: RetryPolicy = NO_RETRY,
    stop: threading.Event | None = None,
) -> Any:
    """Pull download ``ref`` from cell ``source`` and return what the consumer builds.

    Args:
        cell: The receiving cell.
        source: FQCN of the sending cell.
        ref: The ref id the sender gave out.
        per_request_timeout_s: Longest wait for one request (the info or one chunk), in seconds.
        consumer_factory: Makes the consumer from the layout and chunk size; `MemoryConsumer`
            (a dict of tensors) by default, or a `DiskConsumer` for a file. A quantized stream's
            consumer is made for its logical layout (`engine.streaming.dequantize`): it gets
            the values, never the wire records.
        max_in_flight: Chunk requests kept outstanding at once.
        budget: Bytes the stream may announce at most (shared with the message's other
            downloads); None for no bound beyond the cell's own.
        min_throughput: Bytes per second the whole stream must keep up on average: a stream
            of N bytes fails after ``per_request_timeout_s + N / min_throughput`` seconds, so
            a sender that trickles chunks cannot hold the receiver for ever. 0: no bound.
        held: When given, the sender is not told that the download is complete: ``(source,
            ref)`` is appended instead, so the stream can be pulled again; `release_held` tells
            the sender later.
        retry: How a request (the info or a chunk) lost to a timeout or a dropped connection is
            asked again; `NO_RETRY` (the default) fails the download at the first loss. Only the
            lost chunk is asked again: what landed is never pulled twice.
        stop: Set when the receiver no longer wants the download (the round or the job
            ended): the info's wait and the pull end at once. None: it runs to its end.

    Raises:
        StreamingError: The sender refused, went silent past the per-request timeout (after
            the retries) or the stream's deadline, stayed unreachable beyond the cell's
            heartbeat timeout, vanished, ``stop`` was set,
            offered a file instead of tensors, or sent something that does not fit; the message
            names the ref and the sender. What was received so far is freed.
        AnnouncementRefused: (a `StreamingError`) What the sender announced is refused before
            anything is pulled: its layout, kind, chunk size, or a size over the budget.
    """

    def consumer_of(info: Message, chunk_bytes: int, where: str) -> ChunkConsumer:
        try:
            layout = StreamLayout.parse(b"".join(bytes(frame) for frame in info.frames))
        except StreamingError as e:
            raise AnnouncementRefused(f"{where}: {e}") from e
        try:
            plan = plan_of(layout)
        except StreamingError as e:
            raise AnnouncementRefused(f"{where}: {e}") from e
        if plan is None:
            if budget is not None:
                budget.take(layout.total_bytes, where, chunk_bytes)
            return consumer_factory(layout, chunk_bytes)
        if budget is not None:  # what the values take here, not what crossed the wire
            budget.take(max(layout.total_bytes, plan.logical.total_bytes), where, chunk_bytes)
        inner = consumer_factory(plan.logical, plan.logical_chunk_bytes(chunk_bytes))
        return DequantizingConsumer(layout, chunk_bytes, plan, inner)

    return _download(
        cell, source, ref, KIND_TENSORS, consumer_of, per_request_timeout_s, max_in_flight, min_throughput, held, retry,
        stop,
    )  # fmt: skip


def download_file(
    cell: Cell,
    source: str,
    ref: str,
    path: Path,
    per_request_timeout_s: float,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    budget: ByteBudget | None = None,
    min_throughput: int = 0,
    retry: RetryPolicy = NO_RETRY,
    stop: threading.Event | None = None,
) -> Path:
    """Pull the file offered as ``ref`` by cell ``source`` into the new file ``path``; return it.

    Args:
        cell: The receiving cell.
        source: FQCN of the sending cell.
        ref: The ref id the sender gave out (`DownloadService.add_file`).
        path: Where to write; it must not exist. Deleted again if the download fails.
        per_request_timeout_s: Longest wait for one request (the info or one chunk), in seconds.
        max_in_flight: Chunk requests kept outstanding at once.
        budget: As `download_tensors`.
        min_throughput: As `download_tensors`.
        retry: As `download_tensors`.
        stop: As `download_tensors`.

    Raises:
        StreamingError: As `download_tensors`, or the sender offers tensors instead of a file.
    """

    def consumer_of(info: Message, chunk_bytes: int, where: str) -> ChunkConsumer:
        size_bytes = info.header.get("size_bytes")
        if type(size_bytes) is not int or size_bytes < 0:
            raise AnnouncementRefused(f"{where}: the sender announced an invalid file size {size_bytes!r}")
        if budget is not None:
            budget.take(size_bytes, where, chunk_bytes)
        return FileConsumer(size_bytes, chunk_bytes, path)

    return _download(
        cell, source, ref, KIND_FILE, consumer_of, per_request_timeout_s, max_in_flight, min_throughput, retry=retry,
        stop=stop,
    )  # fmt: skip


def _download(
    cell: Cell,
    source: str,
    ref: str,
    kind: str,
    consumer_of: Callable[[Message, int, str], ChunkConsumer],
    timeout_s: float,
    max_in_flight: int,
    min_throughput: int,
    held: list[HeldDownload] | None = None,
    retry: RetryPolicy = NO_RETRY,
    stop: threading.Event | None = None,
) -> Any:
    """Ask for the info, check its kind and chunk size, pull every chunk, report completion (or hold it)."""
    where = f"download {ref!r} from {source!r}"
    if type(max_in_flight) is not int or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
    if type(min_throughput) is not int or min_throughput < 0:
        raise ValueError(f"min_throughput must be an integer >= 0, got {min_throughput!r}")
    if stop is not None and stop.is_set():
        raise StreamingError(f"{where}: stopped before it began, the receiver no longer wants it")
    asked = time.monotonic()
    try:
        info = request_with_retries(
            cell, source, CHANNEL, TOPIC_INFO, {"ref": ref}, timeout_s=timeout_s, policy=retry, stop=stop
        )
    except CellError as e:
        if stop is not None and stop.is_set():  # not wanted any more: the sender may free it now
            report_done(cell, source, ref)
        raise StreamingError(f"{where} failed: {e}") from e
    offered = info.header.get("kind", KIND_TENSORS)  # senders before files existed sent no kind
    if offered != kind:
        raise AnnouncementRefused(f"{where}: the sender offers a {offered!r} stream, not {kind!r}")
    chunk_bytes = info.header.get("chunk_bytes")
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        raise AnnouncementRefused(f"{where}: the sender announced an invalid chunk size {chunk_bytes!r}")
    consumer = consumer_of(info, chunk_bytes, where)
    # The stream's deadline counts from the info's answer, less one attempt: retries of the
    # info (the sender away for a moment) do not eat into it.
    started = max(asked, time.monotonic() - timeout_s)
    deadline = math.inf
    if min_throughput:
        deadline = started + timeout_s + consumer.total_bytes / min_throughput
    try:
        puller = ChunkPuller(cell, source, ref, consumer, timeout_s, max_in_flight, deadline, where, retry, stop)
        pulled = time.monotonic()
        puller.run()
        log.debug(
            "%s: %d bytes in %.3f s, %d chunk requests asked again",
            where, consumer.total_bytes, time.monotonic() - pulled, puller.retried,
        )  # fmt: skip
        result = consumer.finish()
    except BaseException:
        consumer.abort()
        if stop is not None and stop.is_set():  # not wanted any more: the sender may free it now
            report_done(cell, source, ref)
        raise
    if held is not None:
        held.append((source, ref))
    else:
        report_done(cell, source, ref)
    return result


def report_done(cell: Cell, source: str, ref: str) -> None:
    """Tell ``source`` that this cell has everything of download ``ref`` (it may free it)."""
    try:
        cell.send(source, CHANNEL, TOPIC_DONE, {"ref": ref})
    except CellError as e:  # the sender frees it on timeout instead
        log.warning("download %r from %r: could not report completion: %s", ref, source, e)


def release_held(cell: Cell, held: Iterable[HeldDownload]) -> None:
    """Report done for downloads pulled with ``held`` (see `download_tensors`): their senders free them.

    Each ``(source, ref)`` is reported once, however often it is listed.
    """
    for source, ref in dict.fromkeys(held):
        report_done(cell, source, ref)
