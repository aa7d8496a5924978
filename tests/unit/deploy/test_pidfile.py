"""Pid files: a record names one process by pid and start time, so a reused pid is never signalled."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.deploy.pidfile import ProcessHandle, ProcessRecord, process_start, read_pid_file, write_pid_file


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_record_written_and_read_back_is_the_same_and_private(tmp_path: Path) -> None:
    record = ProcessRecord.of(os.getpid(), "site-1", "site", ["python", "-m", "engine"])

    write_pid_file(tmp_path / "site-1.pid", record)

    assert read_pid_file(tmp_path / "site-1.pid") == record
    assert (tmp_path / "site-1.pid").stat().st_mode & 0o777 == 0o600
    assert record.is_running()


@pytest.mark.parametrize(
    "text",
    ["", "{", '{"pid": 1}', '{"pid": "1", "started": "x", "name": "a", "kind": "site"}', "[1, 2]"],
    ids=["empty", "not-json", "keys-missing", "pid-a-string", "a-list"],
)
def test_a_malformed_pid_file_names_itself(tmp_path: Path, text: str) -> None:
    (tmp_path / "site-1.pid").write_text(text)

    with pytest.raises(ValueError, match=r"site-1\.pid: not a pid file of flengine"):
        read_pid_file(tmp_path / "site-1.pid")


def test_a_pid_now_held_by_another_process_gives_no_handle(sleeper: subprocess.Popen[bytes]) -> None:
    reused = ProcessRecord(sleeper.pid, "0:1", "site-1", "site")

    assert not reused.is_running()
    assert ProcessHandle.open(reused) is None
    assert sleeper.poll() is None


def test_an_ended_process_gives_no_handle_even_before_it_is_reaped(sleeper: subprocess.Popen[bytes]) -> None:
    record = ProcessRecord.of(sleeper.pid, "site-1", "site", ["sleep", "60"])
    sleeper.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, sleeper.pid, os.WEXITED | os.WNOWAIT)  # ended, and a zombie until reaped

    assert process_start(sleeper.pid) is None
    assert not record.is_running()
    assert ProcessHandle.open(record) is None


def test_a_handle_signals_its_process_and_sees_it_end(sleeper: subprocess.Popen[bytes]) -> None:
    handle = ProcessHandle.open(ProcessRecord.of(sleeper.pid, "site-1", "site", ["sleep", "60"]))
    assert handle is not None

    with handle:
        assert handle.wait(0.1) is False
        assert handle.signal(signal.SIGTERM) is True
        ended = handle.wait(5.0)

    assert ended
    assert sleeper.wait(5.0) == -signal.SIGTERM


def test_a_record_of_a_process_that_is_gone_cannot_be_made() -> None:
    process = subprocess.Popen(["true"])
    process.wait()

    with pytest.raises(ProcessLookupError):
        ProcessRecord.of(process.pid, "site-1", "site", ["true"])
