"""Downloads between real processes over TCP loopback: correctness, refusals, and peers that die."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.cells import Cell, CellSettings, Reply, Status
from engine.cells.retry import RetryPolicy
from engine.errors import AnnouncementRefused, StreamingError
from engine.streaming.consumers import DiskConsumer, MemoryConsumer
from engine.streaming.pull import download_tensors
from engine.streaming.service import CHANNEL, TOPIC_CHUNK, TOPIC_INFO, DownloadService

from .streaming_peer import CHUNK_BYTES, HEARTBEAT, seeded_tensors

PEER = Path(__file__).with_name("streaming_peer.py")


class Processes:
    """Child processes and cells of one test; all are ended when the test ends."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[str]] = []
        self.cells: list[Cell] = []

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, str(PEER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.children.append(child)
        return child

    def cell(self, fqcn: str, connect_to: str | None = None) -> Cell:
        cell = Cell(fqcn, CellSettings(port=0, **HEARTBEAT), connect_to=connect_to).start()
        self.cells.append(cell)
        if connect_to:
            assert cell.wait_connected(timeout_s=10), f"{fqcn} did not connect"
        return cell

    def close(self) -> None:
        for cell in reversed(self.cells):
            cell.stop(timeout_s=3)
        for child in self.children:
            if child.poll() is None:
                child.stdin.close()
                try:
                    child.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait(timeout=5)


@pytest.fixture
def processes() -> Iterator[Processes]:
    opened = Processes()
    yield opened
    opened.close()


def read_line(child: subprocess.Popen[str], prefix: str, timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if line.startswith(prefix):
            return line.split()[1:]
        if not line and child.poll() is not None:
            break
    raise AssertionError(f"peer did not print {prefix!r} (exit code {child.poll()})")


def test_download_from_another_process_is_bitwise_equal(processes: Processes) -> None:
    sender = processes.spawn("serve", "site-1")
    endpoint, ref = read_line(sender, "READY")
    receiver = processes.cell("site-1", connect_to=endpoint)

    received = download_tensors(receiver, "server", ref, per_request_timeout_s=10)

    expected = seeded_tensors()
    assert list(sorted(received)) == sorted(expected)
    assert all(torch.equal(received[name], tensor) for name, tensor in expected.items())


def test_bad_requests_get_error_replies_and_the_service_keeps_serving(processes: Processes) -> None:
    sender = processes.spawn("serve", "site-1")
    endpoint, ref = read_line(sender, "READY")
    stranger = processes.cell("site-2", connect_to=endpoint)
    receiver = processes.cell("site-1", connect_to=endpoint)

    unknown = receiver.request_async("server", CHANNEL, TOPIC_INFO, {"ref": "no-such-ref"}).result(10)
    out_of_range = receiver.request_async("server", CHANNEL, TOPIC_CHUNK, {"ref": ref, "index": 10**6}).result(10)
    not_a_receiver = stranger.request_async("server", CHANNEL, TOPIC_INFO, {"ref": ref}).result(10)

    assert (unknown.status, unknown.reason) == (Status.ERROR, "unknown or finished download 'no-such-ref'")
    assert out_of_range.status is Status.ERROR and "chunk 1000000 is out of range" in out_of_range.reason
    # Refused exactly as an unknown ref: a cell learns nothing of downloads not offered to it.
    assert (not_a_receiver.status, not_a_receiver.reason) == (Status.ERROR, f"unknown or finished download {ref!r}")
    received = download_tensors(receiver, "server", ref, per_request_timeout_s=10)
    assert torch.equal(received["layers.0.weight"], seeded_tensors()["layers.0.weight"])


class ThreadRecordingMemoryConsumer(MemoryConsumer):
    """Notes the thread that places each chunk; raises on chunk ``fail_at`` when it is set."""

    fail_at: int | None = None

    def __init__(self, layout, chunk_bytes) -> None:  # type: ignore[no-untyped-def]
        super().__init__(layout, chunk_bytes)
        self.threads: set[str] = set()
        self.aborted = False

    def accept(self, index, frames) -> None:  # type: ignore[no-untyped-def]
        self.threads.add(threading.current_thread().name)
        if index == self.fail_at:
            raise StreamingError(f"chunk {index} refused by the test")
        super().accept(index, frames)

    def abort(self) -> None:
        self.aborted = True
        super().abort()


class ThreadRecordingDiskConsumer(DiskConsumer):
    def __init__(self, layout, chunk_bytes, path) -> None:  # type: ignore[no-untyped-def]
        super().__init__(layout, chunk_bytes, path)
        self.threads: set[str] = set()

    def accept(self, index, frames) -> None:  # type: ignore[no-untyped-def]
        self.threads.add(threading.current_thread().name)
        super().accept(index, frames)


def test_memory_downloads_place_chunks_on_the_io_thread_and_disk_downloads_on_the_caller(
    processes: Processes, tmp_path: Path
) -> None:
    server = processes.cell("server")
    service = DownloadService(server)
    receiver = processes.cell("site-1", connect_to=server.endpoint)
    refs = [service.add_tensors(seeded_tensors(), CHUNK_BYTES, receivers=["site-1"]) for _ in range(2)]
    made: list[ThreadRecordingMemoryConsumer | ThreadRecordingDiskConsumer] = []

    def in_memory(layout, chunk_bytes):  # type: ignore[no-untyped-def]
        made.append(ThreadRecordingMemoryConsumer(layout, chunk_bytes))
        return made[-1]

    def on_disk(layout, chunk_bytes):  # type: ignore[no-untyped-def]
        made.append(ThreadRecordingDiskConsumer(layout, chunk_bytes, tmp_path / "model.safetensors"))
        return made[-1]

    received = download_tensors(receiver, "server", refs[0], per_request_timeout_s=10, consumer_factory=in_memory)
    file = download_tensors(receiver, "server", refs[1], per_request_timeout_s=10, consumer_factory=on_disk)
    service.close()

    expected = seeded_tensors()
    assert all(torch.equal(received[name], tensor) for name, tensor in expected.items())
    assert file == tmp_path / "model.safetensors" and file.stat().st_size > sum(t.nbytes for t in expected.values())
    assert made[0].threads == {"site-1-io"}  # no hand-off to the pulling thread per chunk
    assert made[1].threads == {threading.current_thread().name}  # a disk may block: never on the I/O thread


def test_a_chunk_refused_on_the_io_thread_fails_the_download_and_the_cell_keeps_working(
    processes: Processes,
) -> None:
    sender = processes.spawn("serve", "site-1")
    endpoint, ref = read_line(sender, "READY")
    receiver = processes.cell("site-1", connect_to=endpoint)
    made: list[ThreadRecordingMemoryConsumer] = []

    def refusing(layout, chunk_bytes):  # type: ignore[no-untyped-def]
        made.append(ThreadRecordingMemoryConsumer(layout, chunk_bytes))
        made[-1].fail_at = 3
        return made[-1]

    with pytest.raises(StreamingError, match="chunk 3 refused by the test"):
        download_tensors(receiver, "server", ref, per_request_timeout_s=10, consumer_factory=refusing)

    assert made[0].aborted and made[0].threads == {"site-1-io"}
    received = download_tensors(receiver, "server", ref, per_request_timeout_s=10)
    assert torch.equal(received["layers.7.weight"], seeded_tensors()["layers.7.weight"])


def test_a_receiving_cell_stopped_mid_download_fails_it_at_once(processes: Processes) -> None:
    server = processes.cell("server")
    service = DownloadService(server)
    receiver = Cell("site-1", CellSettings(**HEARTBEAT), connect_to=server.endpoint).start()
    assert receiver.wait_connected(timeout_s=10)
    ref = service.add_tensors(seeded_tensors(), CHUNK_BYTES, receivers=["site-1"])
    first_chunk_in = threading.Event()

    class StopsTheCell(MemoryConsumer):
        def accept(self, index, frames) -> None:  # type: ignore[no-untyped-def]
            super().accept(index, frames)
            first_chunk_in.set()
            time.sleep(0.2)  # holds the I/O thread while the test stops the cell

    outcome: list[BaseException | None] = []

    def download() -> None:
        try:
            download_tensors(receiver, "server", ref, per_request_timeout_s=30, consumer_factory=StopsTheCell)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    puller = threading.Thread(target=download)
    start = time.monotonic()
    puller.start()
    assert first_chunk_in.wait(10)
    receiver.stop(timeout_s=3)
    puller.join(15)

    assert not puller.is_alive(), "the download hung after its cell stopped"
    assert time.monotonic() - start < 15
    assert len(outcome) == 1 and isinstance(outcome[0], StreamingError), outcome
    service.close()


class SlowDiskConsumer(DiskConsumer):
    """Writes to disk and takes its time, so the sender can die mid-download."""

    first_chunk_in = None

    def accept(self, index, frames) -> None:  # type: ignore[no-untyped-def]
        super().accept(index, frames)
        if SlowDiskConsumer.first_chunk_in is not None:
            SlowDiskConsumer.first_chunk_in()
            SlowDiskConsumer.first_chunk_in = None
        time.sleep(0.1)


def test_sender_killed_mid_download_fails_fast_and_frees_the_partial_file(processes: Processes, tmp_path: Path) -> None:
    sender = processes.spawn("serve", "site-1")
    endpoint, ref = read_line(sender, "READY")
    receiver = processes.cell("site-1", connect_to=endpoint)
    SlowDiskConsumer.first_chunk_in = sender.kill
    per_request_timeout_s = 30.0

    start = time.monotonic()
    with pytest.raises(StreamingError, match=rf"download '{ref}' from 'server'"):
        download_tensors(
            receiver,
            "server",
            ref,
            per_request_timeout_s=per_request_timeout_s,
            consumer_factory=lambda layout, chunk: SlowDiskConsumer(layout, chunk, tmp_path / "partial.safetensors"),
            max_in_flight=1,
        )

    assert time.monotonic() - start < per_request_timeout_s / 2  # noticed by the heartbeat, not the timeout
    assert list(tmp_path.iterdir()) == []


def test_receiver_killed_mid_download_lets_the_sender_free_everything(processes: Processes) -> None:
    server = processes.cell("server")
    service = DownloadService(server, sweep_interval_s=0.2)
    receiver = processes.spawn("fetch", server.endpoint)
    read_line(receiver, "CONNECTED")
    ref = service.add_tensors(seeded_tensors(), CHUNK_BYTES, receivers=["site-1"], timeout_s=1.5)
    receiver.stdin.write(ref + "\n")
    receiver.stdin.flush()
    read_line(receiver, "STARTED")

    receiver.kill()
    deadline = time.monotonic() + 10
    while len(service.registry) and time.monotonic() < deadline:
        time.sleep(0.1)

    assert len(service.registry) == 0
    service.close()


def test_a_sender_announcing_a_lying_header_is_refused(processes: Processes) -> None:
    server = processes.cell("server")
    receiver = processes.cell("site-1", connect_to=server.endpoint)
    lies = {"chunk_bytes": 1024, "chunk_count": 1}
    server.register_handler(
        CHANNEL, TOPIC_INFO, lambda message: Reply(header=lies, frames=[b"\x05\x00\x00\x00\x00\x00\x00\x00{nope"])
    )

    with pytest.raises(AnnouncementRefused, match=r"download 'r1' from 'server': safetensors header is not valid JSON"):
        download_tensors(receiver, "server", "r1", per_request_timeout_s=5)


@pytest.mark.slow  # 6 s of timeouts; the trickling sender below covers the deadline in the default run
def test_a_sender_that_lets_each_chunk_time_out_before_answering_fails_at_its_deadline(processes: Processes) -> None:
    """The time a sender is away (chunks timing out, asked again) pushes the stream's deadline
    back, but by one chunk's retries at most: one that does it chunk after chunk stops there."""
    server = processes.cell("server")
    receiver = processes.cell("site-1", connect_to=server.endpoint)
    service = DownloadService(server)
    ref = service.add_tensors(seeded_tensors(), CHUNK_BYTES, receivers=["site-1"], timeout_s=60)
    attempts: dict[int, int] = {}

    def late(message):  # each chunk's first four requests time out; the fifth is answered
        index = message.header.get("index")
        attempts[index] = attempts.get(index, 0) + 1
        if attempts[index] <= 4:
            time.sleep(0.6)
        return service._on_chunk(message)

    server.unregister_handler(CHANNEL, TOPIC_CHUNK)
    server.register_handler(CHANNEL, TOPIC_CHUNK, late)
    retry = RetryPolicy(retries=4, backoff_s=0.05)
    started = time.monotonic()

    with pytest.raises(StreamingError, match="the sender is too slow"):
        download_tensors(receiver, "server", ref, per_request_timeout_s=0.5, min_throughput=1 << 20, retry=retry)

    # The deadline: 0.5 s + 2 MiB at 1 MiB/s, pushed back by one chunk's retries at most
    # (5 x 0.5 s + 0.75 s), where the sender takes about 3 x 3.3 s (9 chunks, 4 at a time).
    assert time.monotonic() - started < 8
    service.close()


def test_a_sender_that_trickles_chunks_fails_the_download_at_its_deadline(processes: Processes) -> None:
    server = processes.cell("server")
    receiver = processes.cell("site-1", connect_to=server.endpoint)
    service = DownloadService(server)
    tensors = seeded_tensors()  # about 2 MiB: 9 chunks of 256 KiB
    slow_ref = service.add_tensors(tensors, CHUNK_BYTES, receivers=["site-1"], timeout_s=30)

    def trickle(message):  # each chunk well inside the per-request timeout, the whole far too slow
        if message.header.get("ref") == slow_ref:
            time.sleep(0.4)
        return service._on_chunk(message)

    server.unregister_handler(CHANNEL, TOPIC_CHUNK)
    server.register_handler(CHANNEL, TOPIC_CHUNK, trickle)
    started = time.monotonic()

    with pytest.raises(
        StreamingError, match=r"the sender is too slow: \d of 9 chunks of \d+ bytes arrived by the stream.s deadline"
    ):
        download_tensors(
            receiver, "server", slow_ref, per_request_timeout_s=1.0, max_in_flight=1, min_throughput=1 << 20
        )

    elapsed = time.monotonic() - started
    assert 2.5 < elapsed < 3.6  # 1 s + 2 MiB at 1 MiB/s, not the 3.6 s the sender would need
    fast_ref = service.add_tensors(tensors, CHUNK_BYTES, receivers=["site-1"], timeout_s=30)
    got = download_tensors(receiver, "server", fast_ref, per_request_timeout_s=5, min_throughput=1 << 20)
    assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    service.close()


@pytest.mark.parametrize("topic", [TOPIC_INFO, TOPIC_CHUNK])
def test_a_download_its_receiver_stops_ends_at_once_and_the_cells_go_on(processes: Processes, topic: str) -> None:
    """A sender that holds a request (the info, or every chunk after the first) cannot hold the
    receiver past its ``stop``: the wait ends within a fraction of a second, not the per-request
    timeout, the sender hears it may free the download, and both cells serve the next one."""
    server = processes.cell("server")
    receiver = processes.cell("site-1", connect_to=server.endpoint)
    service = DownloadService(server)
    ref = service.add_tensors(seeded_tensors(), CHUNK_BYTES, receivers=["site-1"], timeout_s=60)
    release, held = threading.Event(), threading.Event()
    serve = service._on_info if topic == TOPIC_INFO else service._on_chunk

    def holding(message):
        if topic == TOPIC_INFO or message.header.get("index") != 0:
            held.set()
            release.wait(30)
        return serve(message)

    server.unregister_handler(CHANNEL, topic)
    server.register_handler(CHANNEL, topic, holding)
    stop = threading.Event()
    outcome: list[BaseException | None] = []

    def download() -> None:
        try:
            download_tensors(receiver, "server", ref, per_request_timeout_s=30, retry=RetryPolicy(), stop=stop)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    puller = threading.Thread(target=download)
    puller.start()
    try:
        assert held.wait(10)
        stopped = time.monotonic()
        stop.set()
        puller.join(5)
        assert not puller.is_alive(), "the download went on after its stop was set"
        assert time.monotonic() - stopped < 1.0
        assert len(outcome) == 1 and isinstance(outcome[0], StreamingError), outcome
        assert "stopped" in str(outcome[0])
    finally:
        release.set()
    deadline = time.monotonic() + 5  # the sender's held handlers are free again: it hears "done"
    while len(service.registry) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(service.registry) == 0  # told it is not wanted, not kept for its 60 s timeout
    server.unregister_handler(CHANNEL, topic)
    server.register_handler(CHANNEL, topic, serve)
    tensors = seeded_tensors()
    again = service.add_tensors(tensors, CHUNK_BYTES, receivers=["site-1"], timeout_s=60)
    got = download_tensors(receiver, "server", again, per_request_timeout_s=10)
    assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    service.close()
