"""Vanished peers: requests fail as unreachable within the heartbeat timeout; cells reconnect.

Peers are child processes killed with SIGKILL, so nothing says goodbye. Heartbeats are 0.2 s
with a 1 s timeout; every request here has a 30 s timeout, so a fast failure cannot be the
request timing out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from engine.errors import CellError, CellUnreachableError

from .harness import HEARTBEAT_TIMEOUT_S, Harness, Peer

REQUEST_TIMEOUT_S = 30.0
# Detection takes the heartbeat timeout plus one sweep; the rest is slack for a busy machine.
DETECTION_BOUND_S = HEARTBEAT_TIMEOUT_S + 2.0


class Outcome:
    """Runs a blocking request on a thread and records how and when it ended."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.error: BaseException | None = None
        self.ended_at = 0.0
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as e:  # inspected by the test
            self.error = e
        self.ended_at = time.monotonic()

    def wait(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"request still blocked after {timeout_s} s"


def _kill_while_busy(peer: Peer) -> float:
    """Give the requester time to be blocked on the peer, then kill the peer."""
    time.sleep(0.3)
    killed_at = time.monotonic()
    peer.kill()
    return killed_at


def test_request_to_killed_client_fails_unreachable_within_heartbeat_timeout(harness: Harness) -> None:
    server = harness.cell("server")
    peer = harness.peer("site-1", connect=server.endpoint)
    outcome = Outcome(lambda: server.request("site-1", "test", "sleep", header={"s": 60}, timeout_s=REQUEST_TIMEOUT_S))

    killed_at = _kill_while_busy(peer)
    outcome.wait(DETECTION_BOUND_S + 5)

    assert isinstance(outcome.error, CellUnreachableError), outcome.error
    assert "site-1" in str(outcome.error) and "'sleep'" in str(outcome.error)
    assert outcome.ended_at - killed_at < DETECTION_BOUND_S
    assert "site-1" not in server.peers()


def test_relayed_request_to_killed_client_fails_unreachable(harness: Harness) -> None:
    server = harness.cell("server")
    asker = harness.cell("site-9", connect_to=server.endpoint)
    peer = harness.peer("site-2", connect=server.endpoint)
    outcome = Outcome(lambda: asker.request("site-2", "test", "sleep", header={"s": 60}, timeout_s=REQUEST_TIMEOUT_S))

    killed_at = _kill_while_busy(peer)
    outcome.wait(DETECTION_BOUND_S + 5)

    assert isinstance(outcome.error, CellUnreachableError), outcome.error
    assert "no heartbeat from site-2" in str(outcome.error)
    assert outcome.ended_at - killed_at < DETECTION_BOUND_S


def test_killed_server_fails_requests_fast_and_client_reconnects(
    harness: Harness, free_port: int, wait_for: Callable[[Callable[[], bool], float, str], None]
) -> None:
    server = harness.peer("server", serve_port=free_port)
    client = harness.cell("site-1", connect_to=server.endpoint)
    outcome = Outcome(lambda: client.request("server", "test", "sleep", header={"s": 60}, timeout_s=REQUEST_TIMEOUT_S))

    killed_at = _kill_while_busy(server)
    outcome.wait(DETECTION_BOUND_S + 5)

    assert isinstance(outcome.error, CellUnreachableError), outcome.error
    assert outcome.ended_at - killed_at < DETECTION_BOUND_S
    wait_for(lambda: not client.connected, 5, "the client to see the server gone")
    with pytest.raises(CellUnreachableError, match="not connected to the server"):
        client.request("server", "test", "echo", timeout_s=REQUEST_TIMEOUT_S)

    harness.peer("server", serve_port=free_port)  # the same endpoint comes back

    assert client.wait_connected(15), "client did not reconnect to the restarted server"
    reply = client.request("server", "test", "echo", frames=[b"again"], timeout_s=10)
    assert bytes(reply.frames[0]) == b"again"


def test_restarted_client_is_reachable_under_the_same_name(harness: Harness) -> None:
    server = harness.cell("server")
    first = harness.peer("site-1", connect=server.endpoint)
    first_pid = server.request("site-1", "test", "pid", timeout_s=10).header["pid"]

    first.kill()
    harness.peer("site-1", connect=server.endpoint)

    deadline = time.monotonic() + 10
    while True:  # until the new process answers; the old one may still be registered
        try:
            pid = server.request("site-1", "test", "pid", timeout_s=2).header["pid"]
        except CellError:
            pid = first_pid
        if pid != first_pid or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert pid != first_pid


def test_a_peer_forgotten_by_the_server_fails_its_waiting_requests_at_once(harness: Harness) -> None:
    # The runtime knows the peer's process ended (its parent said so) before any heartbeat is missed.
    server = harness.cell("server")
    peer = harness.peer("site-1", connect=server.endpoint)
    outcome = Outcome(lambda: server.request("site-1", "test", "sleep", header={"s": 60}, timeout_s=REQUEST_TIMEOUT_S))
    time.sleep(0.3)

    forgotten_at = time.monotonic()
    server.forget_peer("site-1", "site-1 is dead: its process exited with code -9")
    outcome.wait(5)

    assert isinstance(outcome.error, CellUnreachableError), outcome.error
    assert "its process exited with code -9" in str(outcome.error)
    assert outcome.ended_at - forgotten_at < 0.5  # not the heartbeat timeout
    peer.kill()
