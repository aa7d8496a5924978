"""The handler pool hands replies over after its bookkeeping; the envelope's wire bytes."""

from __future__ import annotations

import threading
import time

import msgpack

from engine.cells.envelope import PROTOCOL_VERSION, Envelope, encode_envelope
from engine.cells.pool import HandlerPool
from engine.cells.protocol import Kind, Status


def test_pool_hands_a_jobs_result_over() -> None:
    results: list[object] = []
    handed = threading.Event()
    pool = HandlerPool(2, "test", on_result=lambda r: (results.append(r), handed.set()))
    pool.start()

    assert pool.submit(lambda: "reply", "site-1")
    assert handed.wait(5)
    assert results == ["reply"]
    pool.submit(lambda: None, "site-1")  # None: nothing to hand over
    time.sleep(0.1)
    assert results == ["reply"]
    assert pool.stop(time.monotonic() + 5) == 0


def test_pool_hands_over_the_result_of_a_job_that_ends_during_stop() -> None:
    results: list[object] = []
    release = threading.Event()
    pool = HandlerPool(1, "test", on_result=results.append)
    pool.start()
    pool.submit(lambda: (release.wait(5), "late reply")[1])
    time.sleep(0.05)
    threading.Timer(0.1, release.set).start()

    assert pool.stop(time.monotonic() + 5) == 0
    assert results == ["late reply"]


def test_envelope_bytes_are_the_documented_array() -> None:
    envelope = Envelope(
        Kind.REPLY, 7, "server", "site-1", "task", "get", reply_to=3, status=Status.ERROR, reason="no",
        timeout_ms=5, header={"a": [1, 2]},
    )  # fmt: skip
    expected = msgpack.packb(
        [PROTOCOL_VERSION, 2, 7, "server", "site-1", "task", "get", 3, "error", "no", 5, {"a": [1, 2]}],
        use_bin_type=True,
    )
    assert encode_envelope(envelope) == expected
