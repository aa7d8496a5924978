"""`DownloadService.bytes_served`: the chunk bytes served to each requester (what download progress counts)."""

from __future__ import annotations

import torch
from safetensors.torch import save

from engine.cells import Cell, CellSettings
from engine.streaming.pull import download_tensors
from engine.streaming.service import DownloadService

from .streaming_peer import CHUNK_BYTES, HEARTBEAT, seeded_tensors


def test_bytes_served_counts_every_chunk_byte_per_requester() -> None:
    server = Cell("server", CellSettings(port=0, **HEARTBEAT)).start()
    receiver = Cell("site-1", CellSettings(port=0, **HEARTBEAT), connect_to=server.endpoint).start()
    try:
        assert receiver.wait_connected(timeout_s=10)
        service = DownloadService(server)
        tensors = seeded_tensors()
        ref = service.add_tensors(tensors, CHUNK_BYTES, receivers=["site-1"])
        assert service.bytes_served() == {}

        received = download_tensors(receiver, "server", ref, per_request_timeout_s=10)
        served = service.bytes_served()
        service.close()
    finally:
        receiver.stop(timeout_s=3)
        server.stop(timeout_s=3)

    assert all(torch.equal(received[name], tensor) for name, tensor in tensors.items())
    assert served == {"site-1": len(save(tensors))}  # the stream is a safetensors file: header and data
