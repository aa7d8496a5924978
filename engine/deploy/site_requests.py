"""What the server daemon asks of a job's sites: take the job (deploy), start it, start it again
after the server restarted (resume), stop it (abort). Each returns or logs the sites that failed."""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine.cells import Cell
from engine.deploy import protocol
from engine.deploy.job_store import JobRecord
from engine.errors import CellError
from engine.site import SiteEndpoint

log = logging.getLogger(__name__)


def deploy_to_sites(
    endpoint: SiteEndpoint, archive: Path, workspace: Path, record: JobRecord, sites: Sequence[str], port: int
) -> tuple[list[str], dict[str, str]]:
    """Offer the job's archive (a copy, served to ``sites`` only) to each site.

    Returns:
        The sites that accepted, and why each other one refused.
    """
    folder = Path(tempfile.mkdtemp(prefix=f"deploy-{record.job_id}-", dir=workspace))
    copy = folder / "job.zip"
    shutil.copyfile(archive, copy)
    ref = endpoint.service.add_file(
        copy, protocol.ARCHIVE_CHUNK_BYTES, list(sites), protocol.DEPLOY_TIMEOUT_S, owned_folder=folder
    )
    header = {
        "job_id": record.job_id,
        "name": record.name,
        "submitter": record.submitter,
        "org": record.submitter_org,
        "port": port,
        "ref": ref,
        "digest": record.digest,
        "size": copy.stat().st_size,
        "sites": list(sites),
    }

    def ask(site: str) -> tuple[str, str | None]:
        try:
            reply = endpoint.cell.request(
                site, protocol.SITE_CHANNEL, protocol.TOPIC_DEPLOY, header, timeout_s=protocol.DEPLOY_TIMEOUT_S
            )
        except CellError as e:
            return site, f"no answer: {e}"
        if reply.header.get("accepted") is True:
            return site, None
        return site, str(reply.header.get("reason") or reply.reason or "refused")[:500]

    with concurrent.futures.ThreadPoolExecutor(len(sites)) as pool:
        answers = list(pool.map(ask, sites))
    accepted = [site for site, why in answers if why is None]
    return accepted, {site: why for site, why in answers if why is not None}


def start_sites(cell: Cell, job_id: str, sites: Sequence[str]) -> dict[str, str]:
    """Tell every site that accepted the job to start it; return the ones that could not."""
    failed = {}
    for site in sites:
        try:
            cell.request(site, protocol.SITE_CHANNEL, protocol.TOPIC_START, {"job_id": job_id}, timeout_s=30.0)
        except CellError as e:
            failed[site] = f"could not start the job: {e}"
    return failed


def resume_sites(cell: Cell, job_id: str, port: int, sites: Sequence[str]) -> dict[str, str]:
    """Tell each site to start the job's process again (for the port the job listens on now); return the failures."""
    failed = {}
    header = {"job_id": job_id, "port": port, "sites": list(sites)}
    for site in sites:
        try:
            reply = cell.request(site, protocol.SITE_CHANNEL, protocol.TOPIC_RESUME, header, timeout_s=30.0)
        except CellError as e:
            failed[site] = f"could not resume the job: {e}"
            continue
        if reply.header.get("resumed") is not True:
            failed[site] = str(reply.header.get("reason") or reply.reason or "refused to resume")[:500]
    return failed


def abort_sites(cell: Cell, job_id: str, sites: Sequence[str], reason: str) -> None:
    """Tell each site to stop the job's process (or drop the prepared job); a site that does not answer is logged."""
    for site in sites:
        try:
            header = {"job_id": job_id, "reason": reason}
            cell.request(site, protocol.SITE_CHANNEL, protocol.TOPIC_ABORT, header, timeout_s=30.0)
        except CellError as e:
            log.warning("could not tell %s to stop job %s: %s", site, job_id, e)
