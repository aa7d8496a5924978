"""Fixtures for the cells integration tests: real sockets on 127.0.0.1, real processes.

Every cell and process a test opens is closed by its fixture, and every wait is bounded, so a
failing test fails instead of hanging.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from engine.cells import CellSettings

from .harness import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S, Harness


@pytest.fixture(scope="session")
def fast_settings() -> CellSettings:
    """Short heartbeats, so that a vanished peer is noticed within about a second."""
    return CellSettings(
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        max_message_size_bytes=1 << 30,
        request_timeout_s=20.0,
    )


@pytest.fixture
def harness(fast_settings: CellSettings) -> Iterator[Harness]:
    """Cells and peers for one test."""
    h = Harness(fast_settings)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def wait_for() -> Callable[[Callable[[], bool], float, str], None]:
    """A bounded poll: ``wait_for(predicate, timeout_s, what)`` fails naming ``what``."""

    def wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.02)

    return wait


@pytest.fixture(autouse=True, scope="module")
def _no_leaked_cells() -> Iterator[None]:
    """Fail the module if cell I/O threads outlive the fixtures that opened them."""
    yield
    leftover = [t.name for t in threading.enumerate() if t.name.endswith("-io")]
    assert not leftover, f"cell I/O threads left running: {leftover}"
