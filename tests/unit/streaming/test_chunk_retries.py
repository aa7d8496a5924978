"""Chunk requests lost to a timeout or a dropped connection are asked again, for the missing chunks only
(real cells on 127.0.0.1; faults placed by a hook in the sender's chunk handler or a proxy the test cuts)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from engine.cells import Cell, CellSettings, Message, Reply
from engine.cells.retry import RetryPolicy, request_with_retries
from engine.errors import StreamingError
from engine.streaming.consumers import MemoryConsumer
from engine.streaming.pull import download_tensors
from engine.streaming.service import CHANNEL, TOPIC_CHUNK, DownloadService
from tests.integration.cells.proxy import CutProxy

SETTINGS = CellSettings(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
CHUNK_BYTES = 16 * 1024
TENSORS = {"w": torch.arange(64 * 1024, dtype=torch.float32), "b": torch.linspace(0, 1, 3000)}
CHUNKS = -(
    -sum(t.numel() * t.element_size() for t in TENSORS.values()) // CHUNK_BYTES
)  # of the tensor bytes; the safetensors header adds at most one


class Link:
    """A server cell that receives, a site cell that sends (through ``proxy`` if given), and a hook on its chunks."""

    def __init__(self, proxy: bool = False) -> None:
        self.server = Cell("server", SETTINGS).start()
        self.proxy = CutProxy(self.server.endpoint) if proxy else None
        endpoint = self.proxy.endpoint if self.proxy else self.server.endpoint
        self.site = Cell("site-1", SETTINGS, connect_to=endpoint).start()
        assert self.site.wait_connected(10)
        self.service = DownloadService(self.site)
        self.asked: collections.Counter[int] = collections.Counter()  # chunk index -> requests served
        self.hook: Callable[[int, int], None] = lambda index, nth: None
        serve = self.service._on_chunk

        def on_chunk(message: Message) -> Reply:
            index = message.header["index"]
            self.asked[index] += 1
            self.hook(index, self.asked[index])
            return serve(message)

        self.site.unregister_handler(CHANNEL, TOPIC_CHUNK)
        self.site.register_handler(CHANNEL, TOPIC_CHUNK, on_chunk)
        self.ref = self.service.add_tensors(TENSORS, CHUNK_BYTES, ["server"])

    def pull(self, timeout_s: float, policy: RetryPolicy, max_in_flight: int = 4) -> dict[str, torch.Tensor]:
        return download_tensors(self.server, "site-1", self.ref, timeout_s, MemoryConsumer, max_in_flight, retry=policy)

    def close(self) -> None:
        self.service.close()
        self.site.stop(timeout_s=3)
        if self.proxy:
            self.proxy.close()
        self.server.stop(timeout_s=3)


@pytest.fixture
def link() -> Iterator[Link]:
    opened = Link()
    yield opened
    opened.close()


@pytest.fixture
def proxied_link() -> Iterator[Link]:
    opened = Link(proxy=True)
    yield opened
    opened.close()


def assert_equal(received: dict[str, torch.Tensor]) -> None:
    assert received.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert torch.equal(received[name], tensor), name


def test_a_chunk_that_times_out_is_asked_again_and_its_late_reply_is_dropped(link: Link) -> None:
    released = threading.Event()
    link.hook = lambda index, nth: released.wait(5) if (index, nth) == (5, 1) else None  # first answer held back

    received = link.pull(timeout_s=0.3, policy=RetryPolicy(retries=3, backoff_s=0.05))
    released.set()  # now the first answer to chunk 5 goes out, long after it was given up on

    assert_equal(received)
    assert link.asked[5] == 2
    assert all(n == 1 for index, n in link.asked.items() if index != 5)  # what landed is never asked again
    deadline = time.monotonic() + 5
    while link.server.stats().get("late_replies", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert link.server.stats().get("late_replies") == 1  # dropped by the cell, never placed


def test_a_late_reply_is_never_taken_for_the_retry_s_answer() -> None:
    with Cell("server", SETTINGS) as server, Cell("site-1", SETTINGS, connect_to=server.endpoint) as site:
        assert site.wait_connected(10)
        calls: list[int] = []
        first_out = threading.Event()

        def answer(message: Message) -> Reply:
            calls.append(len(calls) + 1)
            attempt = len(calls)
            if attempt == 1:
                first_out.wait(5)  # answered only after the retry was answered
            return Reply(header={"attempt": attempt})

        site.register_handler("demo", "q", answer)
        reply = request_with_retries(server, "site-1", "demo", "q", timeout_s=0.2, policy=RetryPolicy(2, 0.05))
        first_out.set()
        deadline = time.monotonic() + 5
        while server.stats().get("late_replies", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)

        assert reply.header["attempt"] == 2
        assert server.stats().get("late_replies") == 1


def test_a_chunk_lost_every_time_fails_the_download_after_its_retries(link: Link) -> None:
    link.hook = lambda index, nth: time.sleep(0.5) if index == 2 else None

    with pytest.raises(
        StreamingError, match=r"chunk 2 failed \(timeout\): .*gave up after 2 retries \(streaming_retries = 2\)"
    ):
        link.pull(timeout_s=0.2, policy=RetryPolicy(retries=2, backoff_s=0.05))

    assert link.asked[2] == 3


def test_without_retries_the_first_lost_chunk_fails_the_download(link: Link) -> None:
    link.hook = lambda index, nth: time.sleep(0.5) if index == 2 else None

    with pytest.raises(StreamingError, match=r"chunk 2 failed \(timeout\): server: no reply within 0.2 s$"):
        link.pull(timeout_s=0.2, policy=RetryPolicy(retries=0))


def test_a_dropped_connection_resumes_at_the_first_missing_chunk(proxied_link: Link) -> None:
    link = proxied_link
    assert link.proxy is not None
    dropped = threading.Event()

    def drop_at_chunk_6(index: int, nth: int) -> None:
        if index == 6 and not dropped.is_set():
            dropped.set()
            link.proxy.drop()  # the sender's connection resets while chunks 6.. are in flight

    link.hook = drop_at_chunk_6
    received = link.pull(timeout_s=2.0, policy=RetryPolicy(retries=5, backoff_s=0.1), max_in_flight=2)

    assert_equal(received)
    assert dropped.is_set()
    # Two in flight: chunk 6 is asked for once chunk 4 landed, so 0..4 landed before the drop and
    # are never asked again; 5 and 6 were in flight (6's answer never left) and are.
    assert all(link.asked[index] == 1 for index in range(5))
    assert link.asked[6] == 2
    assert sum(link.asked.values()) <= CHUNKS + 2 + 2  # the two in flight, and at most what followed them


def test_a_sender_away_beyond_its_heartbeat_timeout_fails_the_download(link: Link) -> None:
    gone = threading.Event()

    def vanish_at_chunk_3(index: int, nth: int) -> None:
        if index == 3 and not gone.is_set():
            gone.set()
            threading.Thread(target=link.site.stop, kwargs={"timeout_s": 2}).start()
            time.sleep(0.5)  # the answer never leaves

    link.hook = vanish_at_chunk_3
    started = time.monotonic()
    with pytest.raises(
        StreamingError,
        match=r"unreachable for \d+\.\d s, longer than its heartbeat timeout \(1 s, cell.heartbeat_timeout_s\)",
    ):
        link.pull(timeout_s=5.0, policy=RetryPolicy(retries=50, backoff_s=0.05))

    assert time.monotonic() - started > SETTINGS.heartbeat_timeout_s  # retried until then, not longer than needed
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"retries": -1}, r"retries: expected an integer >= 0, got -1", id="negative"),
        pytest.param({"retries": True}, r"retries: expected an integer >= 0, got True", id="bool"),
        pytest.param({"backoff_s": 0}, r"backoff_s: expected seconds > 0, got 0", id="zero-backoff"),
        pytest.param({"away_limit_s": -1.0}, r"away_limit_s: expected seconds > 0 or None, got -1.0", id="limit"),
    ],
)
def test_a_retry_policy_refuses_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_the_backoff_doubles_up_to_its_cap() -> None:
    policy = RetryPolicy(retries=8, backoff_s=1.0)

    assert [policy.wait_s(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert RetryPolicy(retries=3, backoff_s=0.5).window_s() == 3.5
