"""An admin command against a server that is down or does not answer fails within 3 s with one line,
measured from outside (the ``flengine`` process, its start included), while a running server still
answers: the check before the session's handshake never stands in for it."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.deploy.poc.prepare import free_port_block
from engine.provision import load_project, provision

PROJECT = """\
name = reach
server {{ host = 127.0.0.1, port = {port}, org = lab }}
sites = [ {{ name = site-1, org = lab }} ]
admins = [ {{ name = alice, org = lab, role = project_admin }} ]
"""
#: The limit from outside: the process starts, loads the kit, asks, prints one line.
LIMIT_S = 3.0


@pytest.fixture
def kits(tmp_path: Path) -> tuple[Path, int]:
    port = free_port_block(1)
    (tmp_path / "project.conf").write_text(PROJECT.format(port=port))
    provision(load_project(tmp_path / "project.conf"), tmp_path / "kits")
    return tmp_path / "kits", port


@contextlib.contextmanager
def unanswered(port: int) -> Iterator[None]:
    """A port whose accept queue is full: the kernel drops each new SYN, as for a host that is down."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen(0)
        held = []
        try:
            for _ in range(8):  # fill the queue (its length is the backlog + 1 on Linux)
                client = socket.socket()
                client.settimeout(0.3)
                try:
                    client.connect(("127.0.0.1", port))
                except TimeoutError:
                    client.close()
                    break
                held.append(client)
            else:
                pytest.skip("the kernel never stopped answering a full accept queue here")
            yield
        finally:
            for client in held:
                client.close()


def admin(kits: Path, *args: str, tries: int = 3) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the command; its result and wall time, the best of ``tries`` (this machine is shared: a
    start slowed by other work is not the wait measured here)."""
    best: tuple[subprocess.CompletedProcess[str], float] | None = None
    for _ in range(tries):
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "engine", "admin", str(kits / "alice"), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        wall_s = time.monotonic() - started
        if best is None or wall_s < best[1]:
            best = (done, wall_s)
        if wall_s < LIMIT_S:
            break
    assert best is not None
    return best


def test_a_server_that_is_not_running_fails_the_command_within_3_s(kits: tuple[Path, int]) -> None:
    folder, port = kits

    done, wall_s = admin(folder, "list")

    assert wall_s < LIMIT_S, f"took {wall_s:.1f} s"
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"Error: the server at tcp://127.0.0.1:{port} is not running: nothing listens on port {port} of "
        "127.0.0.1 (start it, or check the kit's server address)\n"
    )


def test_a_server_that_does_not_answer_fails_the_command_within_3_s(kits: tuple[Path, int]) -> None:
    folder, port = kits

    with unanswered(port):
        done, wall_s = admin(folder, "status", "0123456789ab", "--format", "json")

    assert wall_s < LIMIT_S, f"took {wall_s:.1f} s"
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"Error: the server at tcp://127.0.0.1:{port} did not answer within 1.5 s")
    assert json.loads(done.stdout)["exit_code"] == 1
