"""A site's results of a job (its log, figures and models) handed to the server when its job process ends.

The client daemon packs the site's folder of the job workspace and offers it to the server with
its "job ended" message; the server pulls it into the job's workspace next to its own folder
(``<job>/workspace/site-1``), so ``flengine admin download JOB`` brings back every site's results
with the server's. Nothing is taken that the server did not expect: only from a site the job ran
on, while the job runs or for `RESULTS_GRACE_S` after it ended, once per site (claimed
atomically, so that concurrent announcements of one site cost one download), at most
`MAX_RESULTS_BYTES` at no less than the engine's throughput floor, checked against the announced
digest and unpacked with the archive checks (no ``..``, no links).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from engine.deploy import protocol
from engine.deploy.archive import archive_digest, pack_job, unpack_job
from engine.deploy.job_store import RESULTS_CLAIM_PREFIX, JobRecord
from engine.deploy.transfer import pull_archive
from engine.errors import FlengineError
from engine.site import SiteEndpoint

log = logging.getLogger(__name__)

#: The largest results archive a site may hand to the server.
MAX_RESULTS_BYTES = protocol.MAX_JOB_ARCHIVE_BYTES
#: Seconds after a job ended during which the server still takes its sites' results.
RESULTS_GRACE_S = 300.0


def offer_results(endpoint: SiteEndpoint, folder: Path, server: str) -> dict[str, Any]:
    """Pack ``folder`` and offer it to ``server``; return the header fields that announce it (empty on failure)."""
    if not folder.is_dir():
        return {}
    scratch = Path(tempfile.mkdtemp(prefix="results-", dir=folder.parent))
    try:
        archive = pack_job(folder, scratch / "results.zip", max_bytes=MAX_RESULTS_BYTES)
        size, digest = archive.stat().st_size, archive_digest(archive)
        ref = endpoint.service.add_file(archive, protocol.ARCHIVE_CHUNK_BYTES, [server], 300.0, owned_folder=scratch)
    except (FlengineError, OSError) as e:
        shutil.rmtree(scratch, ignore_errors=True)
        log.warning("results of %s not offered: %s", folder, e)
        return {}
    return {"ref": ref, "size": size, "digest": digest}


def results_window_open(job: JobRecord, now: datetime | None = None) -> bool:
    """Whether the server still takes the results of ``job``'s sites: it runs, or ended under `RESULTS_GRACE_S` ago.

    Args:
        job: The job's record.
        now: The time to judge by (UTC); the time now by default.
    """
    if not job.is_final:
        return True
    try:
        ended = datetime.fromisoformat(job.finished_at or "")
    except ValueError:  # a broken record, or one with no end: nothing more is taken
        return False
    if ended.tzinfo is None:
        ended = ended.replace(tzinfo=timezone.utc)
    return (now or datetime.now(timezone.utc)) - ended < timedelta(seconds=RESULTS_GRACE_S)


def results_settled(job: JobRecord, workspace: Path) -> bool:
    """Whether no more results of ``job``'s sites will land in ``workspace``: the window closed, no claim is open."""
    if results_window_open(job):
        return False
    return not any(path.name.startswith(RESULTS_CLAIM_PREFIX) for path in workspace.iterdir())


def take_results(
    endpoint: SiteEndpoint, source: str, header: Mapping[str, Any], dest: Path, *, job: JobRecord | None = None
) -> Path | None:
    """Pull the results a site announced in ``header`` into ``dest`` (which must not exist); None if none.

    The site's slot is claimed first by creating ``.taking-<dest name>`` next to ``dest``
    (atomic), so a second announcement while the first is taken, or after it was, is refused
    before a byte is reserved. A failed attempt frees the slot for a retry.

    Args:
        endpoint: The server's endpoint.
        source: The site's cell.
        header: Its "job ended" header: ``ref``, ``size``, ``digest``, or no ``ref`` for no results.
        dest: The site's folder in the job workspace.
        job: The job's record: results are refused once it ended more than `RESULTS_GRACE_S`
            ago (`results_window_open`). None: no time limit.

    Raises:
        FlengineError: The announcement is malformed, too big or too late, the site's results
            are being taken or were taken, the download failed or was slower than
            the engine's throughput floor, the digest differs, or the archive breaks the
            archive rules; ``dest`` is not created.
    """
    ref, size, digest = header.get("ref"), header.get("size"), header.get("digest")
    if ref is None:
        return None
    if not isinstance(ref, str) or not isinstance(digest, str) or type(size) is not int:
        raise FlengineError("a malformed results announcement")
    if not 0 < size <= MAX_RESULTS_BYTES:
        raise FlengineError(f"results of {size} bytes announced; at most {MAX_RESULTS_BYTES} are taken")
    if job is not None and not results_window_open(job):
        raise FlengineError(
            f"job {job.job_id} ended more than {RESULTS_GRACE_S:g} s ago; its sites' results are no longer taken"
        )
    claim = dest.with_name(RESULTS_CLAIM_PREFIX + dest.name)
    try:
        claim.mkdir(mode=0o700)  # atomic: of concurrent announcements, one wins
    except FileExistsError:
        raise FlengineError(f"results for {dest.name} are being taken already") from None
    except OSError as e:  # the job was deleted, the disk is full...
        raise FlengineError(f"results for {dest.name} cannot be taken: {e.strerror or e}") from e
    try:
        if dest.exists():
            raise FlengineError(f"results for {dest.name} were taken already")
        archive = pull_archive(
            endpoint.cell, source, ref, claim / "results.zip", size, digest, f"the results of {source}"
        )
        return unpack_job(archive, dest, max_bytes=MAX_RESULTS_BYTES)
    finally:
        shutil.rmtree(claim, ignore_errors=True)
