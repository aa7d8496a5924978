"""The download service on cells: senders offer tensors by ref id, receivers pull them in chunks.

Sender: `DownloadService` answers three topics on the ``streaming`` channel: ``info`` (the
stream's safetensors header and chunk size), ``chunk`` (one chunk, as zero-copy frames) and
``done`` (a receiver has everything). Receiver: `download_tensors` asks for the info, then keeps
several chunk requests in flight, each bounded by the per-request timeout, and hands every chunk
to a consumer as it lands.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from engine.cells import Cell, Message, Reply, Status
from engine.errors import CellError, StreamingError
from engine.streaming.consumers import MemoryConsumer, StreamConsumer
from engine.streaming.downloadable import TensorDownloadable
from engine.streaming.layout import StreamLayout
from engine.streaming.transactions import DownloadRefused, DownloadRegistry

log = logging.getLogger(__name__)

CHANNEL = "streaming"
TOPIC_INFO = "info"
TOPIC_CHUNK = "chunk"
TOPIC_DONE = "done"
#: Chunk requests a receiver keeps in flight so the pipe never idles.
DEFAULT_MAX_IN_FLIGHT = 4
#: Seconds between sweeps for transactions whose receivers went silent.
DEFAULT_SWEEP_INTERVAL_S = 5.0

ConsumerFactory = Callable[[StreamLayout, int], StreamConsumer]


class DownloadService:
    """Serves this cell's downloadables to the cells that pull them.

    Args:
        cell: The sending cell; the service registers its handlers on it.
        sweep_interval_s: Seconds between sweeps that drop timed-out transactions.
    """

    def __init__(self, cell: Cell, sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S) -> None:
        self._cell = cell
        self.registry = DownloadRegistry()
        self._closed = threading.Event()
        for topic, handler in ((TOPIC_INFO, self._on_info), (TOPIC_CHUNK, self._on_chunk), (TOPIC_DONE, self._on_done)):
            cell.register_handler(CHANNEL, topic, handler)
        self._sweeper = threading.Thread(
            target=self._sweep, args=(sweep_interval_s,), name=f"downloads-{cell.fqcn}", daemon=True
        )
        self._sweeper.start()

    def add_tensors(
        self,
        tensors: Mapping[str, torch.Tensor],
        chunk_bytes: int,
        receivers: Iterable[str] | None = None,
        timeout_s: float = 600.0,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Offer ``tensors`` for download; return the ref id receivers pull them by.

        Args:
            tensors: Name -> tensor, served from their own memory (do not change them meanwhile).
            chunk_bytes: Chunk size in bytes (> 0).
            receivers: Cells that will download; the tensors are released when all are done.
                None: anyone with the ref, released on timeout or `close` only.
            timeout_s: Seconds without a request after which the offer is dropped.
            metadata: Optional safetensors ``__metadata__``.
        """
        return self.registry.add(TensorDownloadable(tensors, chunk_bytes, metadata), receivers, timeout_s)

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
        header = {"chunk_bytes": downloadable.chunk_bytes, "chunk_count": downloadable.chunk_count}
        return Reply(header=header, frames=[downloadable.layout.header])

    def _on_chunk(self, message: Message) -> Reply:
        index = message.header.get("index")
        try:
            return Reply(
                header={"index": index}, frames=self.registry.chunk(message.header.get("ref"), message.source, index)
            )
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

    Raises:
        StreamingError: The sender refused, went silent past the per-request timeout, vanished,
            or sent something that does not fit; the message names the ref and the sender.
            What was received so far is freed.
    """
    where = f"download {ref!r} from {source!r}"
    try:
        info = cell.request(source, CHANNEL, TOPIC_INFO, {"ref": ref}, timeout_s=per_request_timeout_s)
    except CellError as e:
        raise StreamingError(f"{where} failed: {e}") from e
    chunk_bytes = info.header.get("chunk_bytes")
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        raise StreamingError(f"{where}: the sender announced an invalid chunk size {chunk_bytes!r}")
    try:
        layout = StreamLayout.parse(b"".join(bytes(frame) for frame in info.frames))
    except StreamingError as e:
        raise StreamingError(f"{where}: {e}") from e
    consumer = consumer_factory(layout, chunk_bytes)
    try:
        _pull_chunks(cell, source, ref, consumer, per_request_timeout_s, max_in_flight, where)
        result = consumer.finish()
    except BaseException:
        consumer.abort()
        raise
    try:
        cell.send(source, CHANNEL, TOPIC_DONE, {"ref": ref})
    except CellError as e:  # the sender frees it on timeout instead
        log.warning("%s: could not report completion: %s", where, e)
    return result


def _pull_chunks(
    cell: Cell, source: str, ref: str, consumer: StreamConsumer, timeout_s: float, max_in_flight: int, where: str
) -> None:
    in_flight: collections.deque[tuple[int, concurrent.futures.Future[Message]]] = collections.deque()
    next_index, started = 0, time.monotonic()

    def ask() -> None:
        nonlocal next_index
        future = cell.request_async(
            source, CHANNEL, TOPIC_CHUNK, {"ref": ref, "index": next_index}, timeout_s=timeout_s
        )
        in_flight.append((next_index, future))
        next_index += 1

    while next_index < consumer.chunk_count and len(in_flight) < max_in_flight:
        ask()
    while in_flight:
        index, future = in_flight.popleft()
        try:
            # The cell resolves every request by its own timeout; the margin only guards that.
            reply = future.result(timeout=timeout_s + 5.0)
        except concurrent.futures.TimeoutError as e:
            raise StreamingError(f"{where}: chunk {index} got no answer within {timeout_s:g} s") from e
        if not reply.ok:
            raise StreamingError(f"{where}: chunk {index} failed ({reply.status.value}): {reply.reason}")
        if next_index < consumer.chunk_count:
            ask()  # before placing this chunk, so the pipe stays full
        consumer.accept(index, reply.frames)
    elapsed = time.monotonic() - started
    log.debug("%s: %d bytes in %.3f s", where, consumer.layout.total_bytes, elapsed)
