"""Two real cells over TCP loopback with a message codec on each end: the server's streams its
tensors from a `DownloadService` in chunks of a given size, the client's pulls them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from engine import fobs
from engine.cells import Cell, CellSettings
from engine.model import register_model_types
from engine.streaming.codec import MessageCodec
from engine.streaming.service import DownloadService
from engine.streaming.via_downloader import StreamingContext


@dataclass
class CodecPair:
    """The server cell, its download service, and the codecs that encode there and decode at site-1."""

    server: Cell
    service: DownloadService
    sender: MessageCodec
    receiver: MessageCodec


@contextlib.contextmanager
def codec_pair(chunk_bytes: int) -> Iterator[CodecPair]:
    """A started server cell and client cell ``site-1``, with codecs of ``chunk_bytes`` chunks; all closed after."""
    settings = CellSettings(port=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    server = Cell("server", settings).start()
    client = Cell("site-1", settings, connect_to=server.endpoint).start()
    service = DownloadService(server, sweep_interval_s=0.2)
    try:
        assert client.wait_connected(timeout_s=10)
        registry = fobs.new_registry()
        register_model_types(registry)
        yield CodecPair(
            server,
            service,
            MessageCodec(
                registry, StreamingContext(server, service, chunk_bytes, chunk_bytes, per_request_timeout_s=10)
            ),
            MessageCodec(registry, StreamingContext(client, per_request_timeout_s=10)),
        )
    finally:
        service.close()
        client.stop(timeout_s=3)
        server.stop(timeout_s=3)
