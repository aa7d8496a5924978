"""The download service on cells: senders offer tensors or files by ref id for receivers to pull in chunks.

The sender's side: `DownloadService` answers three topics on the ``streaming`` channel: ``info``
(what the stream is, ``kind`` = ``"tensors"`` with the safetensors header as a frame, or
``"file"`` with its size, and the chunk size), ``chunk`` (one chunk, as frames) and ``done`` (a
receiver has everything). The receiver's side is `engine.streaming.pull`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from engine.cells import Cell, Message, Reply, Status
from engine.cells.retry import DEFAULT_RETRIES
from engine.errors import DownloadRefused, StreamingError
from engine.fault_points import fault_point
from engine.streaming.downloadable import FileDownloadable, TensorDownloadable
from engine.streaming.transactions import LONGEST_WAIT_S, DownloadRegistry

log = logging.getLogger(__name__)

CHANNEL = "streaming"
TOPIC_INFO = "info"
TOPIC_CHUNK = "chunk"
TOPIC_DONE = "done"
#: Seconds between sweeps for transactions whose receivers went silent.
DEFAULT_SWEEP_INTERVAL_S = 5.0


class DownloadService:
    """Serves this cell's downloadables to the cells that pull them.

    Args:
        cell: The sending cell; the service registers its handlers on it.
        sweep_interval_s: Seconds between sweeps that drop timed-out transactions.
        retries: The job's ``streaming_retries``: how often a receiver may ask a chunk again
            in a pull (it bounds the requests one receiver is served, `chunk_requests_allowed`).
    """

    def __init__(
        self, cell: Cell, sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S, retries: int = DEFAULT_RETRIES
    ) -> None:
        self._cell = cell
        self.registry = DownloadRegistry(retries=retries)
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

    def wait_finished(
        self,
        refs: Iterable[str],
        idle_limit_s: float,
        stop: threading.Event | None = None,
        longest_s: float = LONGEST_WAIT_S,
    ) -> bool:
        """Wait until every receiver of the offers ``refs`` finished (see `DownloadRegistry.wait_finished`)."""
        return self.registry.wait_finished(refs, idle_limit_s, stop, longest_s)

    def wait_pulls_finished(
        self,
        refs: Iterable[str],
        idle_limit_s: float,
        stop: threading.Event | None = None,
        longest_s: float = LONGEST_WAIT_S,
    ) -> bool:
        """Wait until the receivers that began to pull ``refs`` finished (`DownloadRegistry.wait_pulls_finished`)."""
        return self.registry.wait_pulls_finished(refs, idle_limit_s, stop, longest_s)

    def hold(self, refs: Iterable[str]) -> None:
        """Keep serving the offers ``refs`` past their timeout, until their receivers report done or `drop`.

        For a result a receiver folded into a sum and may pull once more (see `release_held`).
        """
        self.registry.hold(refs)

    def drop(self, refs: Iterable[str]) -> list[str]:
        """Free the offers ``refs`` now, whatever their receivers did; return the ones that were open."""
        return self.registry.drop(refs)

    def open_offers(self) -> int:
        """How many offers are served now (held ones included)."""
        return len(self.registry)

    def never_pulled(self, refs: Iterable[str]) -> set[str]:
        """Receivers of the offers ``refs`` that never asked for a chunk (see `DownloadRegistry.never_pulled`)."""
        return self.registry.never_pulled(refs)

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
            fault_point("chunk_served")  # the fault suite's hook: a crash mid-download
            return Reply(header={"index": index}, frames=frames)
        except (DownloadRefused, StreamingError) as e:
            return Reply(status=Status.ERROR, reason=str(e))

    def _on_done(self, message: Message) -> None:
        self.registry.finish(message.header.get("ref"), message.source)

    def _sweep(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            self.registry.expire()
