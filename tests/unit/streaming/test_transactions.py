"""The sender's book of downloads: who may pull what, and when everything is freed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from engine.errors import AnnouncementRefused, DownloadRefused, StreamingError
from engine.streaming.downloadable import FileDownloadable, TensorDownloadable
from engine.streaming.layout import StreamLayout
from engine.streaming.pull import ByteBudget
from engine.streaming.transactions import (
    MAX_INFO_SERVED,
    SERVED_SLACK,
    DownloadRegistry,
    chunk_requests_allowed,
)


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def downloadable(**tensors: torch.Tensor) -> TensorDownloadable:
    return TensorDownloadable(tensors or {"w": torch.arange(1000.0)}, chunk_bytes=1024)


def test_chunks_of_a_downloadable_are_those_of_its_layout() -> None:
    tensors = {"w": torch.arange(1000.0), "b": torch.ones(3)}
    served = TensorDownloadable(tensors, chunk_bytes=1024)

    stream = b"".join(bytes(p) for i in range(served.chunk_count) for p in served.chunk(i))

    assert stream[: len(served.layout.header)] == StreamLayout.of_tensors(tensors).header
    assert len(stream) == served.layout.total_bytes


def test_a_non_contiguous_tensor_is_copied_once_and_cached() -> None:
    weight = torch.arange(64.0).reshape(8, 8).t()  # a transposed view
    served = TensorDownloadable({"w": weight}, chunk_bytes=16)

    first = [served.chunk(i) for i in range(served.chunk_count)]

    assert len(served._copies) == 1
    data = b"".join(bytes(p) for pieces in first for p in pieces)[len(served.layout.header) :]
    assert data == weight.contiguous().numpy().tobytes()


def test_the_copy_cache_is_bounded_in_bytes() -> None:
    tensors = {f"t{i}": torch.arange(256.0).reshape(16, 16).t() for i in range(4)}  # 1 KiB each
    served = TensorDownloadable(tensors, chunk_bytes=512, copy_cache_bytes=2048)

    for index in range(served.chunk_count):
        served.chunk(index)

    assert served._copied_bytes <= 2048
    assert len(served._copies) == 2


def test_only_chunks_ready_in_memory_may_be_served_on_the_io_thread(tmp_path: Path) -> None:
    registry = DownloadRegistry()
    in_place = registry.add(downloadable(w=torch.arange(8.0), b=torch.ones(2)), ["site-1"], 60.0)
    transposed = registry.add(downloadable(w=torch.arange(64.0).reshape(8, 8).t()), ["site-1"], 60.0)
    (tmp_path / "f.bin").write_bytes(b"x" * 100)
    on_disk = registry.add(FileDownloadable(tmp_path / "f.bin", 10), ["site-1"], 60.0)

    assert registry.serves_from_memory(in_place)
    assert not registry.serves_from_memory(transposed)  # copied to contiguous memory first
    assert not registry.serves_from_memory(on_disk)  # read from disk
    assert registry.serves_from_memory("unknown")  # answered with a quick error


def test_registry_serves_its_receivers_and_frees_after_the_last() -> None:
    registry = DownloadRegistry()
    served = downloadable()
    ref = registry.add(served, ["site-1", "site-2"], timeout_s=60)

    assert registry.chunk(ref, "site-1", 0)
    assert registry.finish(ref, "site-1") is False
    assert registry.finish(ref, "site-2") is True
    assert len(registry) == 0
    assert served.tensors == {}


@pytest.mark.parametrize(
    ("ref", "requester", "index", "match"),
    [
        pytest.param("nope", "site-1", 0, r"unknown or finished download 'nope'", id="unknown-ref"),
        # A cell the download was not offered to hears what it would hear of an unknown ref.
        pytest.param(None, "site-9", 0, r"unknown or finished download '[0-9a-f]+'", id="not-a-receiver"),
        pytest.param(
            None, "site-1", 99, r"chunk 99 is out of range: download '[0-9a-f]+' has 4 chunks", id="index-out-of-range"
        ),
        pytest.param(None, "site-1", "0", r"chunk '0' is out of range", id="index-not-int"),
    ],
)
def test_registry_refuses_bad_requests(ref: str | None, requester: str, index: object, match: str) -> None:
    registry = DownloadRegistry()
    real = registry.add(downloadable(), ["site-1"], timeout_s=60)

    with pytest.raises(DownloadRefused, match=match):
        registry.chunk(ref or real, requester, index)  # type: ignore[arg-type]

    assert registry.chunk(real, "site-1", 0)  # the service keeps serving


def test_a_receiver_asking_for_the_same_chunks_without_end_is_refused_and_the_others_are_served() -> None:
    """Each receiver may be served 2 pulls of every chunk asked (retries + 1) times, plus a slack,
    and the info `MAX_INFO_SERVED` times; past that it is refused and counts as done."""
    registry = DownloadRegistry(retries=2)
    ref = registry.add(downloadable(), ["site-1", "site-2"], timeout_s=60)  # 4 chunks
    allowed = chunk_requests_allowed(4, retries=2)
    assert allowed == 2 * 3 * 4 + SERVED_SLACK

    for _ in range(allowed):
        assert registry.chunk(ref, "site-1", 3)  # the same chunk, over and over
    with pytest.raises(DownloadRefused, match=rf"site-1 was served {allowed} chunk requests of its 4 chunks already"):
        registry.chunk(ref, "site-1", 0)
    for _ in range(MAX_INFO_SERVED):
        registry.lookup(ref, "site-2")
    with pytest.raises(DownloadRefused, match=r"its info was given to site-2 32 times already"):
        registry.lookup(ref, "site-2")

    assert len(registry) == 0  # both refused past their share: done, and the download is freed


def test_an_honest_receiver_retrying_every_chunk_and_pulling_again_is_served() -> None:
    registry = DownloadRegistry(retries=5)
    ref = registry.add(downloadable(), ["site-1"], timeout_s=60)  # 4 chunks

    for _pull in range(2):  # a pull, then a pull again into a rebuilt sum
        registry.lookup(ref, "site-1")
        for index in range(4):
            for _attempt in range(6):  # every answer late but the last, with 5 retries
                assert registry.chunk(ref, "site-1", index)
    assert len(registry) == 1


def test_requests_refused_past_a_receivers_share_do_not_keep_the_download_alive() -> None:
    clock = FakeClock()
    registry = DownloadRegistry(clock, retries=0)
    ref = registry.add(downloadable(), ["site-1", "site-2"], timeout_s=10)
    for _ in range(chunk_requests_allowed(4, retries=0)):
        registry.chunk(ref, "site-1", 0)

    for _ in range(2):  # refused every 6 s: the 10 s timeout runs on from the last answered one
        clock.now += 6
        with pytest.raises(DownloadRefused, match="refused"):
            registry.chunk(ref, "site-1", 0)
    registry.expire()

    assert len(registry) == 0


def test_a_download_must_name_its_receivers() -> None:
    registry = DownloadRegistry()

    with pytest.raises(StreamingError, match="must name the cells that may pull it"):
        registry.add(downloadable(), [], timeout_s=60)

    assert len(registry) == 0


def test_a_vanished_receiver_lets_the_transaction_time_out() -> None:
    clock = FakeClock()
    registry = DownloadRegistry(clock)
    served = downloadable()
    ref = registry.add(served, ["site-1", "site-2"], timeout_s=10)
    registry.finish(ref, "site-1")

    clock.now = 9.0
    registry.chunk(ref, "site-2", 1)  # activity pushes the deadline
    clock.now = 18.0
    assert registry.expire() == []
    clock.now = 19.5
    assert registry.expire() == [ref]

    assert len(registry) == 0
    assert served.tensors == {}
    with pytest.raises(DownloadRefused, match=r"unknown or finished download"):
        registry.chunk(ref, "site-2", 2)


def test_a_held_download_outlives_its_timeout_until_its_receiver_is_done_or_it_is_dropped() -> None:
    clock = FakeClock()
    registry = DownloadRegistry(clock)
    first, second = downloadable(), downloadable()
    held_ref = registry.add(first, ["server"], timeout_s=10)
    dropped_ref = registry.add(second, ["server"], timeout_s=10)
    registry.hold([held_ref, dropped_ref, "unknown"])

    clock.now = 1000.0
    assert registry.expire() == []
    registry.chunk(held_ref, "server", 0)  # still served: the receiver may pull it again
    assert registry.drop([dropped_ref, "unknown"]) == [dropped_ref]
    assert second.tensors == {}
    assert registry.finish(held_ref, "server")
    assert first.tensors == {} and len(registry) == 0
    assert registry.drop([held_ref]) == []


def test_only_a_receiver_can_say_it_is_done() -> None:
    registry = DownloadRegistry()
    served = downloadable()
    ref = registry.add(served, ["server"], timeout_s=60)

    assert not registry.finish(ref, "site-2")  # a peer it was not offered to
    assert len(registry) == 1 and served.tensors
    assert registry.finish(ref, "server") and len(registry) == 0


def test_close_frees_everything() -> None:
    registry = DownloadRegistry()
    served = [downloadable() for _ in range(3)]
    for item in served:
        registry.add(item, ["site-1"], timeout_s=60)

    registry.close()

    assert len(registry) == 0
    assert all(item.tensors == {} for item in served)


def test_wait_finished_returns_when_the_last_receiver_is_done() -> None:
    registry = DownloadRegistry()
    ref = registry.add(downloadable(), ["site-1", "site-2"], timeout_s=60)
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(registry.wait_finished([ref], idle_limit_s=30)))
    waiter.start()

    registry.chunk(ref, "site-1", 0)
    registry.finish(ref, "site-1")
    time.sleep(0.3)
    assert waiter.is_alive()  # site-2 has not pulled yet
    registry.finish(ref, "site-2")
    waiter.join(5)

    assert waited == [True]


def test_wait_finished_gives_up_on_receivers_that_stopped_pulling() -> None:
    clock = FakeClock()
    registry = DownloadRegistry(clock)
    ref = registry.add(downloadable(), ["site-1"], timeout_s=60)
    clock.now = 5.0
    registry.chunk(ref, "site-1", 0)  # a request at t=5 ...

    clock.now = 9.0
    assert registry.wait_finished([ref], idle_limit_s=4.0) is False  # no request for 4 s: gives up
    assert len(registry) == 1  # the offer itself stays until its own timeout
    stop = threading.Event()
    stop.set()
    assert registry.wait_finished([ref], idle_limit_s=100.0, stop=stop) is False
    assert registry.wait_finished(["gone"], idle_limit_s=1.0) is True


def test_wait_finished_ends_after_its_longest_wait_whatever_a_receiver_keeps_asking() -> None:
    """A receiver that asks for a chunk now and then but never finishes holds the waiter no longer."""
    registry = DownloadRegistry()
    ref = registry.add(downloadable(), ["site-1"], timeout_s=60)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            registry.chunk(ref, "site-1", 0)

    threading.Thread(target=trickle, daemon=True).start()
    started = time.monotonic()
    try:
        finished = registry.wait_finished([ref], idle_limit_s=0.5, longest_s=1.0)
    finally:
        stop.set()
    assert finished is False and 0.9 <= time.monotonic() - started < 5


def test_a_byte_budget_is_shared_and_refuses_before_taking() -> None:
    budget = ByteBudget(100, "a result of site-1")

    budget.take(60, "download a", chunk_bytes=4096)
    with pytest.raises(
        AnnouncementRefused, match=r"download b: the sender announced 50 bytes, more than a result of site-1"
    ):
        budget.take(50, "download b", chunk_bytes=4096)
    budget.take(40, "download c", chunk_bytes=4096)

    assert budget.left_bytes == 0


def test_a_byte_budget_refuses_tiny_chunks() -> None:
    budget = ByteBudget(1 << 20, "a result of site-1")

    with pytest.raises(AnnouncementRefused, match="must come in chunks of at least 4096 bytes"):
        budget.take(1 << 20, "download a", chunk_bytes=1)

    budget.take(100, "download b", chunk_bytes=100)  # one chunk: nothing to cut
    assert budget.left_bytes == (1 << 20) - 100
