"""Messages whose tensors travel by download: real cells over TCP loopback, one serialization."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine import fobs
from engine.cells import Cell, CellSettings
from engine.errors import SerializationError
from engine.fobs import DatumType
from engine.model import FLModel, register_model_types
from engine.streaming.service import DownloadService
from engine.streaming.via_downloader import RECEIVERS_PROP, STREAMING_PROP, StreamingContext, install_via_downloader


def streaming_registry() -> fobs.Registry:
    registry = fobs.new_registry()
    register_model_types(registry)
    install_via_downloader(registry)
    return registry


@dataclass
class Sites:
    server: Cell
    service: DownloadService
    clients: dict[str, Cell]
    registry: fobs.Registry

    def send_props(self, receivers: list[str], chunk_bytes: int = 64 * 1024) -> dict:
        context = StreamingContext(self.server, self.service, chunk_bytes, chunk_bytes, per_request_timeout_s=10)
        return {STREAMING_PROP: context, RECEIVERS_PROP: receivers}

    def receive(self, site: str, header: bytes, frames: list) -> object:
        context = StreamingContext(self.clients[site], per_request_timeout_s=10)
        return fobs.deserialize(header, frames, fobs.DecodeContext(props={STREAMING_PROP: context}), self.registry)


@pytest.fixture
def sites() -> Iterator[Sites]:
    settings = CellSettings(port=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    server = Cell("server", settings).start()
    clients = {name: Cell(name, settings, connect_to=server.endpoint).start() for name in ("site-1", "site-2")}
    assert all(cell.wait_connected(timeout_s=10) for cell in clients.values())
    service = DownloadService(server, sweep_interval_s=0.2)
    try:
        yield Sites(server, service, clients, streaming_registry())
    finally:
        service.close()
        for cell in [*clients.values(), server]:
            cell.stop(timeout_s=3)


def model() -> FLModel:
    generator = torch.Generator().manual_seed(3)
    params = {f"layers.{i}.weight": torch.rand(128, 128, generator=generator) for i in range(4)}
    params["layers.0.bias"] = torch.rand(128, generator=generator).to(torch.bfloat16)
    return FLModel(params=params, meta={"NUM_STEPS_CURRENT_ROUND": 10, "mask": np.arange(1000, dtype=np.int32)})


def assert_same(received: FLModel, sent: FLModel) -> None:
    assert list(received.params) == list(sent.params)
    for name, tensor in sent.params.items():
        assert received.params[name].dtype == tensor.dtype
        assert torch.equal(received.params[name], tensor)
    assert np.array_equal(received.meta["mask"], sent.meta["mask"])


def test_tensors_and_arrays_travel_by_download_and_come_back_bitwise(sites: Sites) -> None:
    sent = model()

    header, frames = fobs.serialize(sent, fobs.EncodeContext(props=sites.send_props(["site-1"])), sites.registry)
    received = sites.receive("site-1", header, frames)

    assert len(header) < 2048  # references only: no tensor byte is in the message
    assert sum(f.nbytes for f in frames) < 512
    assert_same(received, sent)


def test_one_serialization_serves_every_receiver_then_is_freed(sites: Sites) -> None:
    sent = model()
    header, frames = fobs.serialize(
        sent, fobs.EncodeContext(props=sites.send_props(["site-1", "site-2"])), sites.registry
    )
    assert len(sites.service.registry) == 2  # one downloadable for the tensors, one for the arrays

    for site in ("site-1", "site-2"):
        assert_same(sites.receive(site, header, frames), sent)

    deadline = time.monotonic() + 5  # the receivers' "done" messages are fire-and-forget
    while len(sites.service.registry) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(sites.service.registry) == 0


def test_chunk_size_zero_sends_tensors_inline(sites: Sites) -> None:
    sent = model()
    context = fobs.EncodeContext(props=sites.send_props(["site-1"], chunk_bytes=0))

    header, frames = fobs.serialize(sent, context, sites.registry)
    received = sites.receive("site-1", header, frames)

    assert len(sites.service.registry) == 0
    assert [d.dot for d in context.datums if d.dot in (DatumType.TENSOR_REF, DatumType.ARRAY_REF)] == []
    assert sum(f.nbytes for f in frames) > 4 * 128 * 128 * 4
    assert_same(received, sent)


def test_a_receiver_without_streaming_context_says_so(sites: Sites) -> None:
    header, frames = fobs.serialize(model(), fobs.EncodeContext(props=sites.send_props(["site-1"])), sites.registry)

    with pytest.raises(
        SerializationError, match=r"the message streams its (tensors|arrays), but this side has no streaming context"
    ):
        fobs.deserialize(header, frames, registry=sites.registry)


def test_arrays_torch_cannot_hold_travel_inline(sites: Sites) -> None:
    names = np.array(["site-1", "site-2"])

    header, frames = fobs.serialize(
        {"names": names}, fobs.EncodeContext(props=sites.send_props(["site-1"])), sites.registry
    )

    assert len(sites.service.registry) == 0
    assert list(sites.receive("site-1", header, frames)["names"]) == ["site-1", "site-2"]
