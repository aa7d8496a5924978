"""Objects that travel as a file, and downloads' requests in flight: real cells over TCP loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine import fobs
from engine.cells import Cell, CellSettings, Message, Reply
from engine.errors import AnnouncementRefused, SerializationError, StreamingError
from engine.streaming.pull import download_tensors
from engine.streaming.service import DownloadService
from engine.streaming.via_downloader import RECEIVERS_PROP, STREAMING_PROP, StreamingContext, install_via_downloader
from engine.streaming.via_file import ViaFileDecomposer

SITES = ("site-1", "site-2", "site-3")
CHUNK_BYTES = 64 * 1024
SETTINGS = CellSettings(port=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)


@dataclass(eq=False)
class Matrix:
    """An application object that is best moved as a file."""

    values: np.ndarray


class MatrixFileDecomposer(ViaFileDecomposer[Matrix]):
    """The example file-based decomposer: ``np.save`` without pickle, and back."""

    def supported_type(self) -> type[Matrix]:
        return Matrix

    def dump_to_file(self, obj: Matrix, path: Path) -> None:
        with path.open("wb") as file:
            np.save(file, obj.values, allow_pickle=False)

    def load_from_file(self, path: Path) -> Matrix:
        return Matrix(np.load(path, allow_pickle=False))


class BrokenLoadDecomposer(MatrixFileDecomposer):
    def load_from_file(self, path: Path) -> Matrix:
        raise ValueError(f"cannot parse {path.name}")


def matrix() -> Matrix:
    return Matrix(np.random.default_rng(5).random((256, 512)))  # 1 MiB: 17 chunks of 64 KiB


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


class CountingService(DownloadService):
    """A download service that counts the chunk requests it is serving at the same time."""

    def __init__(self, cell: Cell, **kwargs: Any) -> None:
        self.in_flight = self.most_in_flight = 0
        self._count_lock = threading.Lock()
        self.serve_delay_s = 0.0
        self.on_chunk: Callable[[int], None] | None = None
        super().__init__(cell, **kwargs)

    def _served_from_memory(self, message: Message) -> bool:
        return False  # this handler sleeps, which only a pool thread may do

    def _on_chunk(self, message: Message) -> Reply:
        with self._count_lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.on_chunk is not None:
                self.on_chunk(message.header["index"])
            time.sleep(self.serve_delay_s)  # long enough for the next requests to arrive meanwhile
            return super()._on_chunk(message)
        finally:
            with self._count_lock:
                self.in_flight -= 1


@dataclass
class Sites:
    server: Cell
    service: CountingService
    clients: dict[str, Cell]
    send_dir: Path
    receive_dir: Path
    sender: fobs.Registry
    receiver: fobs.Registry

    def send(self, obj: object, receivers: list[str] | None, **settings: Any) -> tuple[bytes, list]:
        context = StreamingContext(
            self.server, self.service, CHUNK_BYTES, CHUNK_BYTES, per_request_timeout_s=10, **settings
        )
        props = {STREAMING_PROP: context} | ({RECEIVERS_PROP: receivers} if receivers is not None else {})
        return fobs.serialize(obj, fobs.EncodeContext(props=props), self.sender)

    def receive(self, site: str, message: tuple[bytes, list], **settings: Any) -> Any:
        context = StreamingContext(self.clients[site], per_request_timeout_s=10, **settings)
        return self.decode(message, context)

    def decode(self, message: tuple[bytes, list], context: StreamingContext) -> Any:
        header, frames = message
        return fobs.deserialize(header, frames, fobs.DecodeContext(props={STREAMING_PROP: context}), self.receiver)

    def sent_files(self) -> list[Path]:
        while True:
            try:
                return sorted(self.send_dir.rglob("*"))
            except FileNotFoundError:  # the sender removed a folder as it was listed: list again
                continue

    def received_files(self) -> list[Path]:
        return sorted(self.receive_dir.rglob("*"))


def registry(temp_dir: Path, decomposer: type[MatrixFileDecomposer] = MatrixFileDecomposer) -> fobs.Registry:
    made = fobs.new_registry()
    install_via_downloader(made)
    made.register(decomposer(temp_dir=temp_dir))
    return made


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    server = Cell("server", SETTINGS).start()
    clients = {name: Cell(name, SETTINGS, connect_to=server.endpoint).start() for name in SITES}
    service = None
    try:
        assert all(cell.wait_connected(timeout_s=10) for cell in clients.values())
        service = CountingService(server, sweep_interval_s=0.1)
        send_dir, receive_dir = tmp_path / "send", tmp_path / "receive"
        send_dir.mkdir()
        receive_dir.mkdir()
        yield Sites(server, service, clients, send_dir, receive_dir, registry(send_dir), registry(receive_dir))
    finally:
        if service is not None:
            service.close()
        for cell in [*clients.values(), server]:
            cell.stop(timeout_s=3)


@pytest.mark.parametrize("receivers", [["site-1"], list(SITES)], ids=["1-receiver", "3-receivers"])
def test_an_object_travels_as_a_file_to_each_receiver_and_the_file_goes_after_the_last(
    sites: Sites, receivers: list[str]
) -> None:
    sent = matrix()

    message = sites.send(sent, receivers)

    header, frames = message
    assert len(header) < 512 and frames == []  # only {ref, owner} travels in the message
    assert [p.name for p in sites.sent_files()][1:] == ["object.bin"]  # its temp folder, and the file
    for index, site in enumerate(receivers):
        if index == len(receivers) - 1:
            assert len(sites.sent_files()) == 2, "the file went before its last receiver was done"
        received = sites.receive(site, message)
        assert np.array_equal(received.values, sent.values) and received.values.dtype == sent.values.dtype
        assert sites.received_files() == []
    wait_for(lambda: sites.sent_files() == [], 5, "the sender's file to be deleted")  # "done" is fire-and-forget
    assert len(sites.service.registry) == 0


def test_the_file_goes_when_the_transaction_times_out(sites: Sites) -> None:
    message = sites.send(matrix(), ["site-1"], transaction_timeout_s=0.3)
    assert len(sites.sent_files()) == 2

    wait_for(lambda: sites.sent_files() == [], 5, "the timed-out file to be deleted")

    with pytest.raises(StreamingError, match=r"download '[0-9a-f]+' from 'server' failed: .*unknown or finished"):
        sites.receive("site-1", message)
    assert sites.received_files() == []


def test_the_files_go_when_the_service_closes_and_it_offers_no_more(sites: Sites) -> None:
    sites.send(matrix(), ["site-1"])
    sites.send(matrix(), ["site-1", "site-2"])
    assert len(sites.sent_files()) == 4

    sites.service.close()

    assert sites.sent_files() == []
    with pytest.raises(SerializationError, match=r"cannot offer a .*Matrix as a file: the download service is closed"):
        sites.send(matrix(), ["site-1"])
    assert sites.sent_files() == []


def test_a_file_offered_to_nobody_is_refused_and_leaves_no_file(sites: Sites) -> None:
    with pytest.raises(SerializationError, match=r"a download must name the cells that may pull it"):
        sites.send(matrix(), None)

    assert sites.sent_files() == []


def test_a_sender_stopped_mid_download_fails_the_receiver_and_leaves_no_temp_file(sites: Sites) -> None:
    message = sites.send(matrix(), ["site-1"])

    def stop_at_chunk_3(index: int) -> None:
        if index == 3:
            threading.Thread(target=sites.server.stop).start()

    sites.service.on_chunk = stop_at_chunk_3

    start = time.monotonic()
    with pytest.raises(StreamingError, match=r"download '[0-9a-f]+' from 'server'"):
        sites.receive("site-1", message, max_in_flight=1)

    assert time.monotonic() - start < 5  # noticed by the heartbeat, not the 10 s request timeout
    assert sites.received_files() == []


def test_a_failed_load_leaves_no_temp_file(sites: Sites) -> None:
    message = sites.send(matrix(), ["site-1"])
    receiver = registry(sites.receive_dir, BrokenLoadDecomposer)
    context = StreamingContext(sites.clients["site-1"], per_request_timeout_s=10)

    with pytest.raises(SerializationError, match=r"ValueError: cannot parse object.bin"):
        fobs.deserialize(*message, fobs.DecodeContext(props={STREAMING_PROP: context}), receiver)

    assert sites.received_files() == []


def test_a_failed_dump_leaves_no_file(sites: Sites) -> None:
    with pytest.raises(SerializationError, match=r"cannot dump a .*Matrix to a file: ValueError: .*allow_pickle=False"):
        sites.send(Matrix(np.array([{"an": "object"}], dtype=object)), ["site-1"])

    assert sites.sent_files() == []
    assert len(sites.service.registry) == 0


@pytest.mark.parametrize("side", ["send", "receive"])
def test_without_a_streaming_context_a_file_based_object_is_refused(sites: Sites, side: str) -> None:
    message = sites.send(matrix(), ["site-1"]) if side == "receive" else None
    verb = "sent" if side == "send" else "received"

    with pytest.raises(
        SerializationError, match=rf"Matrix is {verb} as a file, and a file-based decomposer needs a streaming context"
    ):
        if message is None:
            fobs.serialize(matrix(), registry=sites.sender)
        else:
            fobs.deserialize(*message, registry=sites.receiver)


def test_a_sending_context_without_a_service_is_refused(sites: Sites) -> None:
    context = fobs.EncodeContext(props={STREAMING_PROP: StreamingContext(sites.server)})

    with pytest.raises(SerializationError, match=r"needs a streaming context with a download service"):
        fobs.serialize(matrix(), context, sites.sender)


def test_a_file_ref_is_not_pulled_as_tensors(sites: Sites) -> None:
    path = sites.send_dir / "plain.bin"
    path.write_bytes(b"x" * 100)
    ref = sites.service.add_file(path, 64, ["site-1"], timeout_s=10)

    with pytest.raises(AnnouncementRefused, match=r"the sender offers a 'file' stream, not 'tensors'"):
        download_tensors(sites.clients["site-1"], "server", ref, per_request_timeout_s=10)


def tensors_message() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(CHUNK_BYTES * 10 // 4, dtype=torch.float32)}  # 10 chunks and a bit


@pytest.mark.parametrize("in_flight", [1, 3])
@pytest.mark.parametrize("payload", [matrix, tensors_message], ids=["file", "tensors"])
def test_a_download_keeps_the_configured_requests_in_flight(
    sites: Sites, in_flight: int, payload: Callable[[], Any]
) -> None:
    message = sites.send(payload(), ["site-1"])
    config = {"tensor_download_chunk_size": CHUNK_BYTES, "streaming_max_requests_in_flight": in_flight}
    context = StreamingContext.from_config(sites.clients["site-1"], None, config)
    sites.service.serve_delay_s = 0.05

    sites.decode(message, context)

    assert sites.service.most_in_flight == in_flight
