"""Opens cells here and in child processes for the integration tests, and closes them all."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.cells import Cell, CellSettings

PEER_SCRIPT = Path(__file__).with_name("peer_main.py")
STARTUP_TIMEOUT_S = 30.0
STOP_BOUND_S = 5.0
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.0


@dataclass
class Peer:
    """A cell running in a child process (see peer_main.py)."""

    fqcn: str
    process: subprocess.Popen[str]
    endpoint: str = ""
    stderr_lines: list[str] = field(default_factory=list)

    def kill(self) -> None:
        """SIGKILL the process: no goodbye, its sockets torn down by the kernel."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)


class Harness:
    """Opens cells in this process and peers in child processes; closes all of them."""

    def __init__(self, settings: CellSettings) -> None:
        self.settings = settings
        self.cells: list[Cell] = []
        self.peers: list[Peer] = []

    def cell(
        self, fqcn: str, connect_to: str | None = None, settings: CellSettings | None = None, wait: bool = True
    ) -> Cell:
        """Start a cell here; a client waits until it is registered unless ``wait`` is off."""
        cell = Cell(fqcn, settings or self.settings, connect_to=connect_to).start()
        self.cells.append(cell)
        if connect_to is not None and wait:
            assert cell.wait_connected(STARTUP_TIMEOUT_S), f"{fqcn} did not register"
        return cell

    def peer(
        self,
        fqcn: str,
        *,
        connect: str | None = None,
        serve_port: int | None = None,
        max_message_size_bytes: int = 1 << 30,
    ) -> Peer:
        """Start a cell in a child process; return once it is bound or registered."""
        where = ["--connect", connect] if connect else ["--serve", str(serve_port)]
        process = subprocess.Popen(
            [
                sys.executable,
                str(PEER_SCRIPT),
                fqcn,
                *where,
                "--heartbeat-interval-s",
                str(self.settings.heartbeat_interval_s),
                "--heartbeat-timeout-s",
                str(self.settings.heartbeat_timeout_s),
                "--max-message-size-bytes",
                str(max_message_size_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        peer = Peer(fqcn, process)
        self.peers.append(peer)
        threading.Thread(target=_collect, args=(process, peer.stderr_lines), daemon=True).start()
        peer.endpoint = _wait_ready(peer)
        return peer

    def close(self) -> None:
        """Stop every cell (checking the stop is bounded) and end every peer."""
        slow = []
        for cell in reversed(self.cells):
            start = time.monotonic()
            cell.stop(timeout_s=3.0)
            if time.monotonic() - start > STOP_BOUND_S:
                slow.append(cell.fqcn)
        for peer in self.peers:
            if peer.process.poll() is None:
                peer.process.stdin.close()  # asks it to stop its cell cleanly
                try:
                    peer.process.wait(timeout=STOP_BOUND_S)
                except subprocess.TimeoutExpired:
                    peer.kill()
                    slow.append(peer.fqcn)
            peer.process.stdout.close()
        assert not slow, f"stopping took longer than {STOP_BOUND_S} s: {slow}"


def _collect(process: subprocess.Popen[str], lines: list[str]) -> None:
    for line in process.stderr:
        lines.append(line)


def _wait_ready(peer: Peer) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(peer.process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(STARTUP_TIMEOUT_S)
    line = result[0].strip() if result else ""
    if not line.startswith("READY "):
        peer.kill()
        raise AssertionError(
            f"peer {peer.fqcn} did not start: stdout={line!r} stderr={''.join(peer.stderr_lines)[-2000:]}"
        )
    return line.split(" ", 1)[1]
