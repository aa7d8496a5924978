"""A site's results of a job (its log, figures and models) handed to the server when its job process ends.

The client daemon packs the site's folder of the job workspace and offers it to the server with
its "job ended" message; the server pulls it into the job's workspace next to its own folder
(``<job>/workspace/site-1``), so ``flengine admin download JOB`` brings back every site's results
with the server's. Nothing is taken that the server did not expect: only from a site the job ran
on, once per site, at most `MAX_RESULTS_BYTES`, checked against the announced digest and
unpacked with the archive checks (no ``..``, no links).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.deploy import protocol
from engine.deploy.archive import archive_digest, pack_job, unpack_job
from engine.errors import FlengineError
from engine.site import SiteEndpoint
from engine.streaming.service import ByteBudget, download_file

log = logging.getLogger(__name__)

#: The largest results archive a site may hand to the server.
MAX_RESULTS_BYTES = protocol.MAX_JOB_ARCHIVE_BYTES


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


def take_results(endpoint: SiteEndpoint, source: str, header: Mapping[str, Any], dest: Path) -> Path | None:
    """Pull the results a site announced in ``header`` into ``dest`` (which must not exist); None if none.

    Raises:
        FlengineError: The announcement is malformed or too big, the download failed, the
            digest differs, or the archive breaks the archive rules; ``dest`` is not created.
    """
    ref, size, digest = header.get("ref"), header.get("size"), header.get("digest")
    if ref is None:
        return None
    if not isinstance(ref, str) or not isinstance(digest, str) or type(size) is not int:
        raise FlengineError("a malformed results announcement")
    if not 0 < size <= MAX_RESULTS_BYTES:
        raise FlengineError(f"results of {size} bytes announced; at most {MAX_RESULTS_BYTES} are taken")
    if dest.exists():
        raise FlengineError(f"results for {dest.name} were taken already")
    scratch = Path(tempfile.mkdtemp(prefix="results-", dir=dest.parent))
    try:
        archive = download_file(
            endpoint.cell,
            source,
            ref,
            scratch / "results.zip",
            per_request_timeout_s=60.0,
            budget=ByteBudget(size, f"the results of {source}"),
        )
        if archive_digest(archive) != digest:
            raise FlengineError("the results archive does not match its announced digest")
        return unpack_job(archive, dest, max_bytes=MAX_RESULTS_BYTES)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
