"""The launcher's children show their own command line (``ps``, tools that find job processes by it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.runtime.launcher import command_line_room
from engine.runtime.launcher_process import command_bytes, set_command_line

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc only")


def command_line_of_a_child_that_sets(words: list[str]) -> tuple[bytes, bytes, bytes]:
    """Fork, let the child call `set_command_line`, and read its /proc/PID/cmdline from here."""
    before = Path("/proc/self/cmdline").read_bytes()
    told_read, told_write = os.pipe()
    done_read, done_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the call, then wait to be read
        try:
            os.close(done_write)  # so that the parent's close is the end of the pipe
            os.write(told_write, b"1" if set_command_line(words) else b"0")
            os.read(done_read, 1)
        finally:
            os._exit(0)
    try:
        ok = os.read(told_read, 1)
        shown = Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        os.close(done_write)
        os.waitpid(pid, 0)
        for fd in (told_read, told_write, done_read):
            os.close(fd)
    return ok, shown, before


def test_a_forked_process_shows_the_command_line_it_sets_and_its_parent_keeps_its_own() -> None:
    # Short enough for the room of any pytest command line (`python -m pytest` has 17 bytes); the
    # launcher reserves the room its children need (`command_line_room`).
    words = ["p", "--site", "s7"]

    ok, shown, before = command_line_of_a_child_that_sets(words)

    assert ok == b"1"
    assert shown.rstrip(b"\0") == command_bytes(words)  # the rest of the room is NULs
    assert len(shown) == len(before)  # written in place, within the room it had
    assert Path("/proc/self/cmdline").read_bytes() == before


def test_a_command_line_longer_than_the_room_is_cut_at_its_end() -> None:
    room = len(Path("/proc/self/cmdline").read_bytes())
    words = ["python", "--site", "site-1", "x" * (2 * room)]

    ok, shown, _ = command_line_of_a_child_that_sets(words)

    assert ok == b"1"
    assert shown == command_bytes(words)[: room - 1] + b"\0"  # its first room - 1 bytes, NUL-ended
    assert len(shown) == room


def test_the_room_grows_with_the_paths_and_the_clients() -> None:
    small = command_line_room(["/job", "/ws"], clients=2)

    assert command_line_room(["/job" * 50, "/ws"], clients=2) - small == 3 * 49 * len("/job")
    assert command_line_room(["/job", "/ws"], clients=8) - small == 12 * 6
