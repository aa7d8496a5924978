"""What every runtime process does: its log file, its peak memory, its events on stdout."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Name of the file each process writes its own figures to, in its workspace folder.
PROCESS_FILE = "process.json"
LOG_FILE = "log.txt"
#: Name of the file the server process writes its outcome to (state, reason, rounds).
RESULT_FILE = "result.json"

log = logging.getLogger(__name__)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


#: Allocations of at least this many bytes get their own mapping, returned to the system on free.
MMAP_THRESHOLD_BYTES = 4 << 20
#: The highest mmap threshold glibc accepts on 64-bit systems (its DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_MAX_BYTES = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def mmap_threshold_for(largest_chunk_bytes: int) -> int:
    """The mmap threshold that keeps received chunks of up to ``largest_chunk_bytes`` off fresh mappings.

    `MMAP_THRESHOLD_BYTES` for the default 2 MiB chunks; for larger chunks, the chunk plus 1 MiB
    (room for ZeroMQ's message header), up to glibc's maximum.
    """
    wanted = max(MMAP_THRESHOLD_BYTES, largest_chunk_bytes + (1 << 20))
    return min(wanted, MMAP_THRESHOLD_MAX_BYTES)


def return_freed_memory_to_the_system(largest_chunk_bytes: int = 0) -> bool:
    """Make glibc map every large allocation on its own (tensors), but not received chunks.

    By default glibc raises its mmap threshold as large blocks are freed, after which model-sized
    buffers come from per-thread arenas that keep freed memory: a server that aggregates in
    several handler threads then holds hundreds of MiB it no longer uses. A fixed threshold
    gives each large buffer back when it is freed. It lies above the largest chunk the job
    streams (`mmap_threshold_for`; 4 MiB for the default 2 MiB chunks), so the buffers that
    chunks are received into are reused rather than mapped and faulted in afresh each time
    (that alone made a 1 GiB round about a third slower on a 2-core VM, and 8 MiB chunks
    arrived at a third of the speed of 2 MiB ones).

    Args:
        largest_chunk_bytes: The largest chunk size of the job (any side's
            ``tensor_download_chunk_size`` or ``np_download_chunk_size``); 0 for the default.

    Returns:
        False where there is no glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    threshold = mmap_threshold_for(largest_chunk_bytes)
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    fixed = mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    fixed = mallopt(_M_TRIM_THRESHOLD, 4 * threshold) == 1 and fixed
    return fixed


def write_process_file(folder: Path, name: str, **fields: Any) -> None:
    """Record this process's pid, peak RSS and ``fields`` in ``folder/process.json``."""
    record = {"name": name, "pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes(), **fields}
    (folder / PROCESS_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def log_to_file(folder: Path, verbose: bool = False) -> None:
    """Send this process's log records to ``folder/log.txt``."""
    handler = logging.FileHandler(folder / LOG_FILE, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


#: Name of the file a job process writes its progress events to, in its workspace folder.
EVENTS_FILE = "events.jsonl"
#: The events file stops growing past this many bytes (a note in the log says so).
MAX_EVENTS_FILE_BYTES = 64 << 20


class EventWriter:
    """Progress events as JSON lines: on stdout for the simulator to show, and in ``events.jsonl`` (thread-safe).

    Every event gets ``at``, the time it happened in seconds since the epoch, so that the
    events of a run's processes line up (``flengine report`` draws them).

    Args:
        stream: Where lines are written for a reader; stdout by default.
        file: A JSON-lines file the events are appended to as well (``<workspace>/events.jsonl``),
            up to ``max_file_bytes``; None for none.
        echo: False to write to ``file`` only (a client: nobody reads its stdout).
        max_file_bytes: The file's size limit (`MAX_EVENTS_FILE_BYTES`).
    """

    def __init__(
        self,
        stream: Any = None,
        file: Path | None = None,
        echo: bool = True,
        max_file_bytes: int = MAX_EVENTS_FILE_BYTES,
    ) -> None:
        self._stream = (stream if stream is not None else sys.stdout) if echo else None
        self._lock = threading.Lock()
        self._file = None
        self._file_bytes_left = max_file_bytes
        if file is not None:
            try:
                self._file = open(file, "a", encoding="utf-8")  # noqa: SIM115 (open for the process's life)
            except OSError as e:
                log.warning("progress events not recorded: file=%s error=%s", file, e)

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "at": round(time.time(), 4), **fields}, default=str)
        with self._lock:
            if self._stream is not None:
                try:
                    self._stream.write(line + "\n")
                    self._stream.flush()
                except (OSError, ValueError):  # nobody listens any more; the log still has it
                    pass
            self._record(line)

    def _record(self, line: str) -> None:
        if self._file is None:
            return
        size = len(line.encode("utf-8")) + 1
        try:
            if size > self._file_bytes_left:
                log.warning("events file full: later events are not recorded file=%s", self._file.name)
                self._file.close()
                self._file = None
                return
            self._file.write(line + "\n")
            self._file.flush()
            self._file_bytes_left -= size
        except (OSError, ValueError) as e:
            log.warning("progress events no longer recorded: %s", e)
            self._file = None

    def close(self) -> None:
        """Close the events file (events after this go to the stream only)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def exit_with_parent(parent_pid: int | None, on_orphaned: Any) -> None:
    """Call ``on_orphaned()`` when the process that started this one goes away (checked every 1 s)."""
    if not parent_pid:
        return

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(1.0):
            if os.getppid() != parent_pid:
                on_orphaned()
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
