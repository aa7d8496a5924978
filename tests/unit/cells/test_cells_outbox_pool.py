"""Outbox wake-ups and the handler pool's bounded stop."""

from __future__ import annotations

import select
import threading
import time

from engine.cells.outbox import Outbox
from engine.cells.pool import HandlerPool


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_outbox_wakes_only_a_sleeping_consumer() -> None:
    outbox = Outbox()
    outbox.put("busy")  # consumer awake: no wake-up byte
    assert not _readable(outbox.fileno())
    assert not outbox.prepare_to_sleep()  # an item is waiting: do not sleep
    assert outbox.drain() == ["busy"]

    assert outbox.prepare_to_sleep()
    outbox.put("a")
    outbox.put("b")

    assert _readable(outbox.fileno())
    outbox.woke()
    assert not _readable(outbox.fileno())
    assert outbox.drain() == ["a", "b"]
    outbox.close()


def test_outbox_refuses_items_after_close() -> None:
    outbox = Outbox()
    outbox.put(1)

    assert outbox.close() == [1]
    assert not outbox.put(2)
    assert outbox.close() == []


def test_pool_runs_jobs_in_parallel_and_survives_a_failing_job() -> None:
    pool = HandlerPool(2, "test")
    pool.start()
    barrier = threading.Barrier(2, timeout=5)
    done = threading.Event()

    pool.submit(lambda: 1 / 0)
    pool.submit(barrier.wait)
    pool.submit(lambda: (barrier.wait(), done.set()))

    assert done.wait(5)
    assert pool.stop(time.monotonic() + 5) == 0


def test_pool_stop_is_bounded_by_a_stuck_job() -> None:
    pool = HandlerPool(1, "test")
    pool.start()
    release = threading.Event()
    pool.submit(lambda: release.wait(30))
    pool.submit(lambda: None)  # queued behind the stuck one: dropped at stop
    time.sleep(0.05)
    start = time.monotonic()

    busy = pool.stop(time.monotonic() + 0.3)

    assert busy == 1 and time.monotonic() - start < 1.0
    assert not pool.submit(lambda: None)
    release.set()
