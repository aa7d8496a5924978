"""The download service on cells: senders offer tensors or files by ref id, receivers pull them in chunks.

Sender: `DownloadService` answers three topics on the ``streaming`` channel: ``info`` (what the
stream is, ``kind`` = ``"tensors"`` with the safetensors header as a frame, or ``"file"`` with
its size, and the chunk size), ``chunk`` (one chunk, as frames) and ``done`` (a receiver has
everything). Receiver: `download_tensors` / `download_file` ask for the info, refuse a stream of
the other kind, then keep several chunk requests in flight, each bounded by the per-request
timeout, and hand every chunk to a consumer as it lands.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from engine.cells import Cell, Message, Reply, Status
from engine.errors import CellError, StreamingError
from engine.streaming.consumers import ChunkConsumer, FileConsumer, MemoryConsumer, StreamConsumer
from engine.streaming.downloadable import KIND_FILE, KIND_TENSORS, FileDownloadable, TensorDownloadable
from engine.streaming.layout import StreamLayout
from engine.streaming.transactions import DownloadRefused, DownloadRegistry

log = logging.getLogger(__name__)

CHANNEL = "streaming"
TOPIC_INFO = "info"
TOPIC_CHUNK = "chunk"
TOPIC_DONE = "done"
#: Chunk requests a receiver keeps in flight so the pipe never idles.
DEFAULT_MAX_IN_FLIGHT = 4
#: Bytes per second a download must keep up on average by default (``streaming_min_throughput``).
DEFAULT_MIN_THROUGHPUT = 256 << 10
#: Seconds between sweeps for transactions whose receivers went silent.
DEFAULT_SWEEP_INTERVAL_S = 5.0

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


class DownloadService:
    """Serves this cell's downloadables to the cells that pull them.

    Args:
        cell: The sending cell; the service registers its handlers on it.
        sweep_interval_s: Seconds between sweeps that drop timed-out transactions.
    """

    def __init__(self, cell: Cell, sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S) -> None:
        self._cell = cell
        self.registry = DownloadRegistry()
        #: Chunks this service has served (a figure for logs and tests).
        self.chunks_served = 0
        self._bytes_served: dict[str, int] = {}  # requester -> chunk bytes served to it
        self._count_lock = threading.Lock()
        self._closed = threading.Event()
        for topic, handler in ((TOPIC_INFO, self._on_info), (TOPIC_DONE, self._on_done)):
            cell.register_handler(CHANNEL, topic, handler)
        cell.register_handler(CHANNEL, TOPIC_CHUNK, self._on_chunk, inline=self._served_from_memory)
        self._sweeper = threading.Thread(
            target=self._sweep, args=(sweep_interval_s,), name=f"downloads-{cell.fqcn}", daemon=True
        )
        self._sweeper.start()

    def add_tensors(
        self,
        tensors: Mapping[str, torch.Tensor],
        chunk_bytes: int,
        receivers: Iterable[str],
        timeout_s: float = 600.0,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Offer ``tensors`` for download; return the ref id receivers pull them by.

        Args:
            tensors: Name -> tensor, served from their own memory (do not change them meanwhile).
            chunk_bytes: Chunk size in bytes (> 0).
            receivers: The cells that will download, and the only ones that may; the tensors
                are released when all are done.
            timeout_s: Seconds without a request after which the offer is dropped.
            metadata: Optional safetensors ``__metadata__``.
        """
        return self.registry.add(TensorDownloadable(tensors, chunk_bytes, metadata), receivers, timeout_s)

    def add_file(
        self,
        path: Path,
        chunk_bytes: int,
        receivers: Iterable[str],
        timeout_s: float = 600.0,
        owned_folder: Path | None = None,
    ) -> str:
        """Offer the file ``path`` for download as a raw byte stream; return its ref id.

        The service owns the file from now on: it is deleted (with ``owned_folder``, if given)
        when all receivers are done, when the offer times out, or when the service closes;
        also at once if the service is already closed.

        Args:
            path: The file; it must not change while served.
            chunk_bytes: Chunk size in bytes (> 0).
            receivers: The cells that will download, and the only ones that may.
            timeout_s: Seconds without a request after which the offer is dropped.
            owned_folder: A folder holding only this file, deleted with it.

        Raises:
            StreamingError: The service is closed, or no receiver is named.
        """
        downloadable = FileDownloadable(path, chunk_bytes, owned_folder)
        try:
            return self.registry.add(downloadable, receivers, timeout_s)
        except StreamingError:
            downloadable.release()
            raise

    def wait_finished(self, refs: Iterable[str], idle_limit_s: float, stop: threading.Event | None = None) -> bool:
        """Wait until every receiver of the offers ``refs`` finished (see `DownloadRegistry.wait_finished`)."""
        return self.registry.wait_finished(refs, idle_limit_s, stop)

    def hold(self, refs: Iterable[str]) -> None:
        """Keep serving the offers ``refs`` past their timeout, until their receivers report done or `drop`.

        For a result a receiver folded into a sum and may pull once more (see `release_held`).
        """
        self.registry.hold(refs)

    def drop(self, refs: Iterable[str]) -> list[str]:
        """Free the offers ``refs`` now, whatever their receivers did; return the ones that were open."""
        return self.registry.drop(refs)

    def drop_receiver(self, refs: Iterable[str], receiver: str) -> None:
        """Stop waiting for ``receiver`` on the offers ``refs`` (it will never pull: it did not take the message)."""
        for ref in refs:
            self.registry.finish(ref, receiver)

    def bytes_served(self) -> dict[str, int]:
        """Chunk bytes served so far, by requester (a cheap snapshot, for progress displays)."""
        with self._count_lock:
            return dict(self._bytes_served)

    def close(self) -> None:
        """Stop serving: unregister the handlers and free every downloadable."""
        if self._closed.is_set():
            return
        self._closed.set()
        for topic in (TOPIC_INFO, TOPIC_CHUNK, TOPIC_DONE):
            self._cell.unregister_handler(CHANNEL, topic)
        self._sweeper.join(timeout=5.0)
        self.registry.close()

    def _on_info(self, message: Message) -> Reply:
        try:
            downloadable = self.registry.lookup(message.header.get("ref"), message.source)
        except DownloadRefused as e:
            return Reply(status=Status.ERROR, reason=str(e))
        header, frames = downloadable.info()
        return Reply(header=header, frames=frames)

    def _served_from_memory(self, message: Message) -> bool:
        """Whether a chunk request may be answered on the cell's I/O thread.

        Yes when its bytes are ready in memory (contiguous CPU tensors), so nothing blocks; GPU
        or non-contiguous tensors (copied first) and files (read from disk) go to the pool.
        """
        return self.registry.serves_from_memory(message.header.get("ref"))

    def _on_chunk(self, message: Message) -> Reply:
        index = message.header.get("index")
        try:
            frames = self.registry.chunk(message.header.get("ref"), message.source, index)
            size = sum(memoryview(frame).nbytes for frame in frames)
            with self._count_lock:
                self.chunks_served += 1
                self._bytes_served[message.source] = self._bytes_served.get(message.source, 0) + size
            return Reply(header={"index": index}, frames=frames)
        except (DownloadRefused, StreamingError) as e:
            return Reply(status=Status.ERROR, reason=str(e))

    def _on_done(self, message: Message) -> None:
        self.registry.finish(message.header.get("ref"), message.source)

    def _sweep(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            self.registry.expire()


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
