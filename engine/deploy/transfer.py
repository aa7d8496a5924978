"""`pull_archive`: how every archive of production mode crosses the network (jobs, results).

A job archive (admin -> server -> sites) and a results archive (site -> server -> admin) are
all pulled the same way: the size the sender announced is the budget (a bigger stream is
refused before anything is reserved), the pull keeps the engine's throughput floor, and the
file must match the sha256 the sender announced before anyone unpacks it.
"""

from __future__ import annotations

from pathlib import Path

from engine.cells import Cell
from engine.deploy.archive import archive_digest
from engine.errors import FlengineError
from engine.streaming.pull import DEFAULT_MIN_THROUGHPUT, ByteBudget, download_file

#: Longest wait for one chunk of an archive, in seconds.
ARCHIVE_REQUEST_TIMEOUT_S = 60.0


def pull_archive(
    cell: Cell,
    source: str,
    ref: str,
    path: Path,
    size: int,
    digest: str,
    what: str,
    request_timeout_s: float = ARCHIVE_REQUEST_TIMEOUT_S,
) -> Path:
    """Pull the archive ``ref`` that ``source`` offered into the new file ``path``; return it.

    Args:
        cell: The receiving cell.
        source: The cell that offered it (the one the announcement came from).
        ref: Its download ref.
        path: Where it goes (must not exist; removed again when the pull fails).
        size: The size the sender announced: the most the stream may hold.
        digest: The sha256 the sender announced.
        what: What it is, for messages (``"the job archive of alice"``).
        request_timeout_s: Longest wait for one chunk.

    Raises:
        StreamingError: The pull failed, was too slow, or the stream is bigger than ``size``.
        FlengineError: The file does not match ``digest`` (it is removed).
    """
    archive = download_file(
        cell,
        source,
        ref,
        path,
        per_request_timeout_s=request_timeout_s,
        budget=ByteBudget(size, what),
        min_throughput=DEFAULT_MIN_THROUGHPUT,
    )
    if archive_digest(archive) != digest:
        archive.unlink(missing_ok=True)
        raise FlengineError(f"{what}: its sha256 differs from the one its sender announced")
    return archive
