"""`FileFollower`: the new lines of files other processes append to (``tail -f`` for the simulator).

The simulator follows each client's ``events.jsonl`` (what the live console shows a site doing)
and, with ``-v``, every process's ``log.txt`` (shown on the console). A file that does not exist
yet is looked for again at the next poll; at most `MAX_READ_BYTES` are read per file and poll, and
a line longer than `MAX_LINE_BYTES` is cut there, so a runaway writer cannot hold the console up.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.runtime.process import EVENTS_FILE, LOG_FILE

#: Bytes read from one file at one poll (the rest waits for the next).
MAX_READ_BYTES = 1 << 20
#: The longest line kept; the rest of a longer line is dropped.
MAX_LINE_BYTES = 64 << 10
#: Seconds between two polls of the follower thread.
POLL_INTERVAL_S = 0.25
#: The events of a client's ``events.jsonl`` that the live display shows (a site's own steps).
CLIENT_EVENTS = frozenset({"task_received", "task_done"})
#: The event made of a line of a process's log (``-v``): ``{"event", "site", "text"}``.
LOG_LINE_EVENT = "log_line"


@dataclass
class _Followed:
    key: str
    path: Path
    offset: int = 0
    partial: bytes = b""
    cutting: bool = False  # dropping the rest of a line that was too long


class FileFollower:
    """Follows files from their current end (or start) and hands each new complete line to ``on_line``.

    Args:
        on_line: Called as ``on_line(key, line)`` for each new line (text, without its newline),
            from the thread that calls `poll` (the follower's own after `start`).
        interval_s: Seconds between polls of the follower thread.
    """

    def __init__(self, on_line: Callable[[str, str], None], interval_s: float = POLL_INTERVAL_S) -> None:
        self._on_line = on_line
        self._interval_s = interval_s
        self._files: list[_Followed] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, key: str, path: Path) -> None:
        """Follow ``path`` from its start (it may not exist yet); its lines are given with ``key``."""
        with self._lock:
            self._files.append(_Followed(key, path))

    def poll(self) -> None:
        """Read what each file gained since the last poll and hand over its complete lines."""
        with self._lock:
            for followed in self._files:
                for line in self._read(followed):
                    self._on_line(followed.key, line)

    def start(self) -> None:
        """Poll every ``interval_s`` in a daemon thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name="file-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then read what is left (the lines written before the processes ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll()

    @staticmethod
    def _read(followed: _Followed) -> list[str]:
        try:
            with followed.path.open("rb") as stream:
                stream.seek(followed.offset)
                data = stream.read(MAX_READ_BYTES)
        except OSError:
            return []
        followed.offset += len(data)
        lines = []
        *complete, rest = (followed.partial + data).split(b"\n")
        for raw in complete:
            if not followed.cutting:
                lines.append(raw[:MAX_LINE_BYTES].decode("utf-8", errors="replace").rstrip("\r"))
            followed.cutting = False
        if len(rest) > MAX_LINE_BYTES:  # a line too long: keep its start, drop the rest when it ends
            if not followed.cutting:
                lines.append(rest[:MAX_LINE_BYTES].decode("utf-8", errors="replace"))
            followed.cutting, rest = True, b""
        followed.partial = rest
        return lines


def follow_run(
    workspace: Path, clients: list[str], put: Callable[[dict[str, Any]], None], *, events: bool, logs: bool
) -> FileFollower | None:
    """Start following a run's files; each line becomes an event handed to ``put``.

    Args:
        workspace: The run's workspace (a folder per process).
        clients: The run's clients.
        put: Takes each event (from the follower's thread).
        events: Follow each client's ``events.jsonl`` (`CLIENT_EVENTS` only, ``site`` set to the
            file's client: a client speaks for itself only).
        logs: Follow every process's ``log.txt`` (`LOG_LINE_EVENT` events).

    Returns:
        The started follower (`FileFollower.stop` it), or None when there is nothing to follow.
    """
    if not (events or logs):
        return None

    def on_line(key: str, line: str) -> None:
        kind, site = key.split(":", 1)
        if kind == "log":
            put({"event": LOG_LINE_EVENT, "site": site, "text": line})
            return
        try:
            event = json.loads(line)
        except ValueError:
            return
        if isinstance(event, dict) and event.get("event") in CLIENT_EVENTS:
            put({**event, "site": site})

    follower = FileFollower(on_line)
    for site in clients if events else []:
        follower.follow(f"events:{site}", workspace / site / EVENTS_FILE)
    for site in ["server", *clients] if logs else []:
        follower.follow(f"log:{site}", workspace / site / LOG_FILE)
    follower.start()
    return follower
