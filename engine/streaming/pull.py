"""Pulling a download from its sender in chunks: the receiver's side of `engine.streaming.service`.

`download_tensors` / `download_file` ask for the info, refuse a stream of the other kind, then
keep several chunk requests in flight, each bounded by the per-request timeout, and hand every
chunk to a consumer as it lands; `ByteBudget` bounds what one message's downloads may announce;
a download pulled with ``held`` is reported done later (`release_held`), so it can be pulled again.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from engine.cells import Cell, Message
from engine.errors import CellError, StreamingError
from engine.streaming.consumers import ChunkConsumer, FileConsumer, MemoryConsumer, StreamConsumer
from engine.streaming.downloadable import KIND_FILE, KIND_TENSORS
from engine.streaming.layout import StreamLayout
from engine.streaming.service import CHANNEL, TOPIC_CHUNK, TOPIC_DONE, TOPIC_INFO

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
            raise StreamingError(
                f"{where}: the sender cut {nbytes} bytes into chunks of {chunk_bytes} bytes; "
                f"{self.what} must come in chunks of at least {self.min_chunk_bytes} bytes"
            )
        with self._lock:
            if nbytes > self.left_bytes:
                raise StreamingError(
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
) -> Any:
    """Pull download ``ref`` from cell ``source`` and return what the consumer builds.

    Args:
        cell: The receiving cell.
        source: FQCN of the sending cell.
        ref: The ref id the sender gave out.
        per_request_timeout_s: Longest wait for one request (the info or one chunk), in seconds.
        consumer_factory: Makes the consumer from the layout and chunk size; `MemoryConsumer`
            (a dict of tensors) by default, or a `DiskConsumer` for a file.
        max_in_flight: Chunk requests kept outstanding at once.
        budget: Bytes the stream may announce at most (shared with the message's other
            downloads); None for no bound beyond the cell's own.
        min_throughput: Bytes per second the whole stream must keep up on average: a stream
            of N bytes fails after ``per_request_timeout_s + N / min_throughput`` seconds, so
            a sender that trickles chunks cannot hold the receiver for ever. 0: no bound.
        held: When given, the sender is not told that the download is complete: ``(source,
            ref)`` is appended instead, so the stream can be pulled again; `release_held` tells
            the sender later.

    Raises:
        StreamingError: The sender refused, went silent past the per-request timeout or the
            stream's deadline, vanished,
            offered a file instead of tensors, or sent something that does not fit; the message
            names the ref and the sender. What was received so far is freed.
    """

    def consumer_of(info: Message, chunk_bytes: int, where: str) -> ChunkConsumer:
        try:
            layout = StreamLayout.parse(b"".join(bytes(frame) for frame in info.frames))
        except StreamingError as e:
            raise StreamingError(f"{where}: {e}") from e
        if budget is not None:
            budget.take(layout.total_bytes, where, chunk_bytes)
        return consumer_factory(layout, chunk_bytes)

    return _download(
        cell, source, ref, KIND_TENSORS, consumer_of, per_request_timeout_s, max_in_flight, min_throughput, held
    )


def download_file(
    cell: Cell,
    source: str,
    ref: str,
    path: Path,
    per_request_timeout_s: float,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    budget: ByteBudget | None = None,
    min_throughput: int = 0,
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

    Raises:
        StreamingError: As `download_tensors`, or the sender offers tensors instead of a file.
    """

    def consumer_of(info: Message, chunk_bytes: int, where: str) -> ChunkConsumer:
        size_bytes = info.header.get("size_bytes")
        if type(size_bytes) is not int or size_bytes < 0:
            raise StreamingError(f"{where}: the sender announced an invalid file size {size_bytes!r}")
        if budget is not None:
            budget.take(size_bytes, where, chunk_bytes)
        return FileConsumer(size_bytes, chunk_bytes, path)

    return _download(cell, source, ref, KIND_FILE, consumer_of, per_request_timeout_s, max_in_flight, min_throughput)


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
) -> Any:
    """Ask for the info, check its kind and chunk size, pull every chunk, report completion (or hold it)."""
    where = f"download {ref!r} from {source!r}"
    if type(max_in_flight) is not int or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
    if type(min_throughput) is not int or min_throughput < 0:
        raise ValueError(f"min_throughput must be an integer >= 0, got {min_throughput!r}")
    started = time.monotonic()
    try:
        info = cell.request(source, CHANNEL, TOPIC_INFO, {"ref": ref}, timeout_s=timeout_s)
    except CellError as e:
        raise StreamingError(f"{where} failed: {e}") from e
    offered = info.header.get("kind", KIND_TENSORS)  # senders before files existed sent no kind
    if offered != kind:
        raise StreamingError(f"{where}: the sender offers a {offered!r} stream, not {kind!r}")
    chunk_bytes = info.header.get("chunk_bytes")
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        raise StreamingError(f"{where}: the sender announced an invalid chunk size {chunk_bytes!r}")
    consumer = consumer_of(info, chunk_bytes, where)
    deadline = math.inf
    if min_throughput:
        deadline = started + timeout_s + consumer.total_bytes / min_throughput
    try:
        _pull_chunks(cell, source, ref, consumer, timeout_s, max_in_flight, deadline, where)
        result = consumer.finish()
    except BaseException:
        consumer.abort()
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


def _pull_chunks(
    cell: Cell,
    source: str,
    ref: str,
    consumer: ChunkConsumer,
    timeout_s: float,
    max_in_flight: int,
    deadline: float,
    where: str,
) -> None:
    puller = _ChunkPuller(cell, source, ref, consumer, timeout_s, max_in_flight, deadline, where)
    started = time.monotonic()
    puller.run()
    elapsed = time.monotonic() - started
    log.debug("%s: %d bytes in %.3f s", where, consumer.total_bytes, elapsed)


class _ChunkPuller:
    """Keeps ``max_in_flight`` chunk requests out and places each reply as it lands.

    A consumer that places chunks in memory (``places_on_io_thread``) takes each reply in the
    request's callback, on the cell's I/O thread, which also asks for the next chunk: a chunk
    then costs no hand-off between threads (about a tenth of a receiver's CPU per GiB on a
    2-core VM). Any other consumer (files, which may block on the disk) takes chunks on the
    calling thread, so the I/O thread never waits on it.
    """

    def __init__(
        self,
        cell: Cell,
        source: str,
        ref: str,
        consumer: ChunkConsumer,
        timeout_s: float,
        max_in_flight: int,
        deadline: float,
        where: str,
    ) -> None:
        self._cell, self._source, self._ref = cell, source, ref
        self._consumer, self._timeout_s, self._where = consumer, timeout_s, where
        self._deadline = deadline  # time.monotonic() by which the whole stream must be in
        self._max_in_flight = max_in_flight
        self._on_io_thread = consumer.places_on_io_thread
        self._lock = threading.Lock()  # guards the counters and the error
        self._place_lock = threading.Lock()  # one accept at a time
        self._landed: queue.SimpleQueue[tuple[int, Message]] = queue.SimpleQueue()
        self._finished = threading.Event()
        self._next_index = 0
        self._outstanding = 0
        self._replies = 0
        self._error: BaseException | None = None

    def run(self) -> None:
        """Pull every chunk; raise the first failure (`StreamingError` for a refused chunk)."""
        if self._consumer.chunk_count == 0:
            return
        for _ in range(min(self._max_in_flight, self._consumer.chunk_count)):
            self._ask()
        # The cell resolves every request by its own timeout; the margin only guards that.
        wait_s = self._timeout_s + 5.0
        while not self._finished.is_set():
            left_s = self._deadline - time.monotonic()
            if left_s <= 0:
                self._fail(self._too_slow())
                continue
            if self._on_io_thread:
                progress = self._replies
                if not self._finished.wait(min(wait_s, left_s)) and self._replies == progress and left_s > wait_s:
                    self._fail(StreamingError(f"{self._where}: no chunk arrived within {self._timeout_s:g} s"))
                continue
            try:
                index, reply = self._landed.get(timeout=min(wait_s, left_s))
            except queue.Empty:
                if left_s > wait_s:
                    self._fail(StreamingError(f"{self._where}: no chunk arrived within {self._timeout_s:g} s"))
                continue
            self._take(index, reply)
        if self._error is not None:
            with self._place_lock:  # no chunk is being placed once the caller aborts the consumer
                pass
            raise self._error

    def _too_slow(self) -> StreamingError:
        with self._lock:
            landed = self._replies
        return StreamingError(
            f"{self._where}: the sender is too slow: {landed} of {self._consumer.chunk_count} chunks of "
            f"{self._consumer.total_bytes} bytes arrived by the stream's deadline (streaming_min_throughput)"
        )

    def _ask(self) -> None:
        with self._lock:
            if self._error is not None or self._next_index >= self._consumer.chunk_count:
                return
            index = self._next_index
            self._next_index += 1
            self._outstanding += 1
        try:
            future = self._cell.request_async(
                self._source, CHANNEL, TOPIC_CHUNK, {"ref": self._ref, "index": index}, timeout_s=self._timeout_s
            )
        except Exception as e:  # the cell stopped: no reply will ever come for this one
            with self._lock:
                self._outstanding -= 1
            self._fail(StreamingError(f"{self._where}: chunk {index} could not be requested: {e}"))
            return
        future.add_done_callback(lambda done: self._on_reply(index, done.result()))

    def _on_reply(self, index: int, reply: Message) -> None:
        if self._on_io_thread:
            self._take(index, reply)
        else:
            self._landed.put((index, reply))

    def _take(self, index: int, reply: Message) -> None:
        error: BaseException | None = None
        if not reply.ok:
            error = StreamingError(f"{self._where}: chunk {index} failed ({reply.status.value}): {reply.reason}")
        else:
            self._ask()  # before placing this chunk, so the pipe stays full
            try:
                with self._place_lock:
                    if self._error is None:
                        self._consumer.accept(index, reply.frames)
            except BaseException as e:  # reported to run(), which aborts the consumer
                error = e
        with self._lock:
            self._outstanding -= 1
            self._replies += 1
            done = self._outstanding == 0
        if error is not None:
            self._fail(error)
        elif done:
            self._finished.set()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._finished.set()
