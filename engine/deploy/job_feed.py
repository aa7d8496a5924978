"""What ``watch`` and ``logs`` answer from a job's growing files: bounded reads from a cursor.

A watcher (``flengine admin watch JOB``, ``flengine admin logs JOB --follow``) polls the server
with a cursor: the byte offset in a file where its last answer ended. Each answer holds the
complete lines after it, from at most `FEED_MAX_BYTES` of the file, and the cursor to ask from
next; ``more`` says the file holds more already (ask again at once). Whatever cursor a client
sends, the server reads and returns at most `FEED_MAX_BYTES` (a cursor past the end reads
nothing), so a poll costs the server the same small work as ``status``.

``watch`` reads the job's server-process events (``<job workspace>/<server>/events.jsonl``: the
rounds, each site's tasks and results, the metrics of each round); ``logs`` a process's
``log.txt``, its last `LOG_LINES` lines first (read from its last `LOG_TAIL_BYTES` only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.deploy.audit import clip
from engine.errors import UsageError

#: Lines of a log that ``logs`` returns at most (the end of the file).
LOG_LINES = 200
#: Bytes read from the end of a log for ``logs``: a log of a billion short lines costs no more.
LOG_TAIL_BYTES = 256 << 10
#: Bytes of a file that one ``watch`` or ``logs --follow`` answer reads at most, whatever the cursor.
FEED_MAX_BYTES = 64 << 10
#: The largest cursor a client may send (a file offset; larger is a malformed request).
MAX_CURSOR = 1 << 62


@dataclass(frozen=True)
class Chunk:
    """Lines read from a file, and where the next read starts.

    Attributes:
        lines: The complete lines read (text, without their newline; invalid UTF-8 replaced).
        offset: The byte offset just after the last line returned: the next cursor.
        more: The read stopped at its size limit and the file holds more after ``offset``
            (ask again at once); a line still being written is not more.
    """

    lines: list[str]
    offset: int
    more: bool


def cursor_of(header: Mapping[str, Any]) -> int | None:
    """The ``offset`` a request names: None when it names none (the first ask).

    Raises:
        UsageError: It is not an integer from 0 to `MAX_CURSOR` (the refusal's reason).
    """
    value = header.get("offset")
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= MAX_CURSOR:
        raise UsageError(f"offset: expected a byte offset from 0 to 2**62, got {clip(repr(value))}")
    return value


def read_from(path: Path, offset: int, max_bytes: int = FEED_MAX_BYTES) -> Chunk:
    """The complete lines of ``path`` from byte ``offset`` on, out of at most ``max_bytes`` read.

    A line still being written (no newline yet) waits for the next read. A line longer than
    ``max_bytes`` is returned in pieces of ``max_bytes``, so a cursor always moves on. A file
    that does not exist (yet), or cannot be read, has no lines; a cursor past its end stays
    there (the file only grows).
    """
    try:
        with path.open("rb") as source:
            size = source.seek(0, os.SEEK_END)
            offset = min(offset, size)
            source.seek(offset)
            data = source.read(max_bytes)
    except OSError:
        return Chunk([], offset, False)
    end = data.rfind(b"\n") + 1
    if end == 0 and len(data) >= max_bytes:  # one line longer than a whole read: hand it over in pieces
        end = len(data)
    # more: the read stopped at its limit, not at the end (a line still being written is not more)
    return Chunk(_lines(data[:end]), offset + end, len(data) >= max_bytes and offset + end < size)


def tail(path: Path, lines: int = LOG_LINES, tail_bytes: int = LOG_TAIL_BYTES) -> Chunk:
    """The last ``lines`` lines of the text file ``path``, read from its last ``tail_bytes`` bytes only.

    A line cut by the start of the read is left out (unless it is the only one), and so is a
    last line still being written (the next read returns it whole). A file that cannot be read
    has no lines. The cursor is the byte offset just after the lines returned.
    """
    try:
        with path.open("rb") as source:
            start = max(0, source.seek(0, os.SEEK_END) - tail_bytes)
            source.seek(start)
            data = source.read(tail_bytes)
    except OSError:
        return Chunk([], 0, False)
    end = data.rfind(b"\n") + 1 or len(data)  # no newline at all: the text there is all there is
    text = _lines(data[:end])
    if start > 0 and len(text) > 1:
        text = text[1:]
    return Chunk(text[-lines:], start + end, False)


def _lines(data: bytes) -> list[str]:
    """``data`` as lines of text: split at each newline only (a ``\\r`` a peer wrote stays, escaped when shown)."""
    if not data:
        return []
    lines = data.decode("utf-8", errors="replace").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def watch_answer(job: dict[str, Any], events_file: Path, offset: int, connected: Mapping[str, float]) -> dict[str, Any]:
    """The answer to one ``watch`` poll.

    Args:
        job: The job's record as ``status`` answers it (read before the events, so that a
            final record comes with every event its job wrote).
        events_file: The job's server-process ``events.jsonl``.
        offset: The cursor the watcher sent (0 the first time).
        connected: The sites heard from lately, as `ServerDaemon.connected_sites` says.

    Returns:
        ``{"job", "events", "offset", "more", "sites"}``: the events written since ``offset``
        (each a JSON object; a line that is not one is skipped), the next cursor, whether more
        is written already, and ``{site: {"connected": bool}}`` for each site of the job.
    """
    chunk = read_from(events_file, offset)
    events = []
    for line in chunk.lines:
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):  # a piece of an over-long line: nothing to show
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
    sites = {site: {"connected": site in connected} for site in job.get("sites") or []}
    return {"job": job, "events": events, "offset": chunk.offset, "more": chunk.more, "sites": sites}
