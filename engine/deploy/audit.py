"""An append-only audit log: one JSON line per admin command, job start and job end.

The server keeps one for every admin command and every job's start and end; each site keeps
one for every job deployed to it, refused, started and ended. A line reads::

    {"time":"2025-01-31T12:00:00.123Z","actor":"carol","action":"abort","outcome":"refused","job":"7f3a","reason":"..."}

Every value is JSON-encoded with non-ASCII characters escaped, so a value from a peer (a
reason, a name) cannot start a line of its own, nor put a control character on a terminal that
shows the log; every string is cut to `MAX_VALUE_CHARS` (`clip`), so a peer that sends a
megabyte of name cannot make a megabyte of log. Each line is written with one ``write`` on a
file opened ``O_APPEND`` and made durable (``fsync``) before `AuditLog.record` returns; the file
is created ``0600``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

from engine.errors import SecurityError

log = logging.getLogger(__name__)

#: The keys every record has; `AuditLog.record` refuses them as details.
RESERVED_KEYS = ("time", "actor", "action", "outcome")
#: Characters of one string value an audit line (or a log line about a peer) keeps; the rest is "...".
MAX_VALUE_CHARS = 200
_MODE = 0o600


class AuditLog:
    """An append-only JSON-lines file that records who did what, and what came of it.

    Thread-safe: threads of one process may share one `AuditLog`. Several processes may append
    to the same file too, as every line goes out in a single ``write`` on an ``O_APPEND`` file.

    Args:
        path: The log file; created (``0600``) if missing, appended to if present. A symbolic
            link is refused.

    Raises:
        SecurityError: The file cannot be opened for appending, is a symbolic link or not a
            regular file, or is readable by others and cannot be made ``0600``.

    Example::

        audit = AuditLog(workspace / "audit.log")
        audit.record("carol", "abort", "refused", job=job_id, reason=reason)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fd: int | None = _open_for_append(self.path)

    def record(self, actor: str, action: str, outcome: str, **details: Any) -> None:
        """Append one line to the log and make it durable before returning.

        Args:
            actor: Who acted: an admin's or site's identity, or the daemon itself.
            action: What was done: an admin action (``submit``, ``abort``...) or a job event
                (``job_started``, ``job_deployed``...).
            outcome: What came of it, e.g. ``ok``, ``refused``, ``failed``.
            **details: More fields of the line: ``job``, ``site``, ``reason``... Values that
                JSON cannot encode are written as their ``str``.

        Every string (the actor, action and outcome too, and strings in lists and dicts) is
        cut to `MAX_VALUE_CHARS` characters by `clip`.

        Raises:
            ValueError: A detail is called like one of `RESERVED_KEYS`, or the log is closed.
            OSError: The line could not be written or made durable (disk full...).
        """
        clash = sorted(set(details) & set(RESERVED_KEYS))
        if clash:
            raise ValueError(f"audit detail keys {clash} are reserved; the keys {list(RESERVED_KEYS)} come first")
        entry = {"time": _now_iso(), "actor": actor, "action": action, "outcome": outcome, **details}
        entry = {key: _clipped(value) for key, value in entry.items()}
        # ensure_ascii: "\n", "\u2028" or an escape sequence from a peer stays inside its string
        line = (json.dumps(entry, ensure_ascii=True, separators=(",", ":"), default=str) + "\n").encode("ascii")
        with self._lock:
            if self._fd is None:
                raise ValueError(f"{self.path}: the audit log is closed")
            _write_all(self._fd, line)
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the file; later `record` calls raise. Closing twice is harmless."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def clip(text: object, limit: int = MAX_VALUE_CHARS) -> str:
    """``str(text)`` cut to ``limit`` characters, ending in ``...`` when cut: for peer-supplied text in logs.

    Example::

        log.warning("job end refused: %s ran no such job", clip(message.source))
    """
    text = str.__str__(text) if isinstance(text, str) else str(text)  # a str enum as its value
    return text if len(text) <= limit else text[:limit] + "..."


def _clipped(value: Any) -> Any:
    """``value`` with every string in it clipped; what JSON cannot encode becomes its clipped ``str``."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_clipped(item) for item in value]
    if isinstance(value, dict):
        return {clip(key): _clipped(item) for key, item in value.items()}
    return clip(value)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read an audit log back, for tests and tools.

    A line that is not a JSON object is skipped with a warning: typically the last line, torn
    when a writer stopped mid-write (`AuditLog` ends such a line before appending to the file).

    Args:
        path: The log file.

    Returns:
        The records, oldest first.
    """
    records = []
    with Path(path).open("rb") as source:
        for number, raw in enumerate(source, start=1):
            try:
                entry = json.loads(raw)
            except ValueError:
                entry = None
            if isinstance(entry, dict):
                records.append(entry)
            elif raw.endswith(b"\n"):
                log.warning("audit log line skipped, not a JSON record: file=%s line=%d", path, number)
            else:
                log.warning("torn last line of audit log skipped: file=%s line=%d", path, number)
    return records


def _open_for_append(path: Path) -> int:
    # O_RDWR rather than O_WRONLY: opening reads the last byte, to end a torn line
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, _MODE)
    except OSError as e:
        why = "it is a symbolic link" if os.path.islink(path) else (e.strerror or str(e))
        raise SecurityError(f"{path}: cannot open the audit log for appending: {why}") from e
    try:
        _check_file(path, fd)
        _end_torn_line(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(path: Path, fd: int) -> None:
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        raise SecurityError(f"{path}: the audit log is not a regular file; give the path of a file")
    if stat.S_IMODE(status.st_mode) != _MODE:
        try:
            os.fchmod(fd, _MODE)
        except OSError as e:
            raise SecurityError(
                f"{path}: the audit log has mode {stat.S_IMODE(status.st_mode):o} and cannot be made 600: "
                f"{e.strerror or e}; run `chmod 600 {path}` as its owner"
            ) from e
        log.warning("audit log mode set to 600: file=%s was=%o", path, stat.S_IMODE(status.st_mode))


def _end_torn_line(path: Path, fd: int) -> None:
    """End a line left torn by a writer that stopped mid-write, so the next record is whole."""
    size = os.fstat(fd).st_size
    if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
        log.warning("audit log ended mid-line (a writer stopped mid-write), ending that line: file=%s", path)
        _write_all(fd, b"\n")
        os.fsync(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _now_iso() -> str:
    """The time now, UTC, ISO-8601 to the millisecond: ``2025-01-31T12:00:00.123Z``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"
