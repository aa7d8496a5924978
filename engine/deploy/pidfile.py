"""Pid files that name exactly one process, so that a pid reused by another process is never signalled.

A pid alone is not an identity: once a process ends, the kernel hands its pid to the next
process that starts. A `ProcessRecord` therefore keeps the pid *and* the process's start time
(on Linux the boot id and the start tick of ``/proc/<pid>/stat``; elsewhere the start time
``ps`` gives), and `ProcessHandle.open` only hands out a handle when both still match. On Linux
the handle is a pidfd, opened before the check: a signal sent through it reaches that process
or nobody, even if the pid is reused between the check and the signal.

Example:
    >>> record = ProcessRecord.of(process.pid, "site-1", "site", command)
    >>> write_pid_file(Path("run/site-1.pid"), record)
    >>> handle = ProcessHandle.open(read_pid_file(Path("run/site-1.pid")))
    >>> if handle is not None:  # None: the process ended, or the pid is another process now
    ...     handle.signal(signal.SIGTERM)
    ...     handle.wait(20.0)
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

_PROC = Path("/proc")
_BOOT_ID = _PROC / "sys" / "kernel" / "random" / "boot_id"
#: Seconds between two looks at a process where no pidfd can say when it ends.
_POLL_INTERVAL_S = 0.05
_MAX_PID_FILE_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class ProcessRecord:
    """What a pid file says about the process it names.

    Attributes:
        pid: The process id.
        started: The process's start time as `process_start` gives it; with ``pid``, its identity.
        name: Whose process it is (a participant's name).
        kind: What it runs (``server`` or ``site``).
        command: Its command line, for people reading the file.
    """

    pid: int
    started: str
    name: str
    kind: str
    command: tuple[str, ...] = ()

    @classmethod
    def of(cls, pid: int, name: str, kind: str, command: list[str] | tuple[str, ...]) -> ProcessRecord:
        """The record of a process that runs now.

        Raises:
            ProcessLookupError: No process ``pid`` runs (it ended already).
        """
        started = process_start(pid)
        if started is None:
            raise ProcessLookupError(f"process {pid} is not running")
        return cls(pid, started, name, kind, tuple(command))

    def is_running(self) -> bool:
        """Whether the recorded process still runs (False when its pid now belongs to another process)."""
        return process_start(self.pid) == self.started


def process_start(pid: int) -> str | None:
    """The start time of process ``pid``, as an opaque string; None when no such process runs.

    A zombie (ended, not yet reaped) counts as not running.
    """
    if pid <= 0:
        return None
    if _PROC.is_dir():
        return _linux_start(pid)
    return _ps_start(pid)


def _linux_start(pid: int) -> str | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
        boot_id = _BOOT_ID.read_text(encoding="ascii").strip() if _BOOT_ID.exists() else ""
    except OSError:
        return None
    # fields after the command name, which may hold spaces and parentheses: state is field 3, starttime field 22
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return f"{boot_id}:{fields[19]}"


def _ps_start(pid: int) -> str | None:
    try:
        done = subprocess.run(
            ["ps", "-o", "stat=", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    state, _, started = done.stdout.strip().partition(" ")
    if done.returncode != 0 or not started or state.startswith("Z"):
        return None
    return started.strip()


def write_pid_file(path: Path, record: ProcessRecord) -> None:
    """Write ``record`` to ``path`` (mode 0600, replaced atomically)."""
    data = dataclasses.asdict(record)
    data["command"] = list(record.command)
    temporary = path.with_name(f".{path.name}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        json.dump(data, out, indent=2)
        out.write("\n")
    os.replace(temporary, path)


def read_pid_file(path: Path) -> ProcessRecord:
    """Read a pid file that `write_pid_file` wrote.

    Raises:
        FileNotFoundError: There is no such file.
        ValueError: The file is not a pid file of this module (the message says why).
    """
    with path.open("rb") as source:
        text = source.read(_MAX_PID_FILE_BYTES)
    try:
        data: Any = json.loads(text)
        record = ProcessRecord(
            pid=data["pid"],
            started=data["started"],
            name=data["name"],
            kind=data["kind"],
            command=tuple(data.get("command", ())),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a pid file of flengine ({e})") from e
    if type(record.pid) is not int or not isinstance(record.started, str) or not isinstance(record.name, str):
        raise ValueError(f"{path}: not a pid file of flengine (pid, started or name of the wrong type)")
    return record


class ProcessHandle:
    """A handle on the process a record names, checked to be that process; signals reach it or nobody.

    Get one with `open`; close it with `close` (or use it as a context manager).
    """

    def __init__(self, record: ProcessRecord, pidfd: int | None) -> None:
        self.record = record
        self._pidfd = pidfd

    @classmethod
    def open(cls, record: ProcessRecord) -> ProcessHandle | None:
        """A handle on the recorded process, or None when it ended or its pid is another process now."""
        pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(record.pid)
            except ProcessLookupError:
                return None
            except OSError:  # a kernel without pidfds: fall back to checking before each signal
                pidfd = None
        # checked after opening the pidfd: the pidfd then names the process that was checked
        if not record.is_running():
            if pidfd is not None:
                os.close(pidfd)
            return None
        return cls(record, pidfd)

    def __enter__(self) -> ProcessHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the pidfd (safe to call twice)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def signal(self, signum: int) -> bool:
        """Send ``signum`` to the process; False when it has ended already."""
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)
            elif self.record.is_running():
                os.kill(self.record.pid, signum)
            else:
                return False
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the process to end; True when it has ended."""
        if self._pidfd is not None:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            return bool(poller.poll(max(0.0, timeout_s) * 1000))
        deadline = time.monotonic() + timeout_s
        while self.record.is_running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_INTERVAL_S)
        return True
