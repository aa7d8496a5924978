"""Resuming a job after the server stopped while it ran: where it runs again.

At start the server daemon queues every job left RUNNING again (`JobStore.recover`, ``resumes``
counted up). Such a job runs again on the sites it ran on, in the same order (a workflow's
sampling draws from that list), once they are all connected; each site starts the job's process
again (`engine.deploy.site_requests.resume_sites`), and the server's job process resumes every workflow from its
checkpoint (``--resume``). Nothing is deployed again: the sites keep the job's folder.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from engine.config import Job
from engine.deploy.job_store import JobRecord
from engine.deploy.scheduler import Impossible, Placement, SiteState, place

log = logging.getLogger(__name__)


def resume_placement(
    record: JobRecord, job: Job, connected: Mapping[str, SiteState], known_sites: Sequence[str]
) -> Placement | str:
    """Where a job queued to resume runs: its earlier sites, in their order; or why it waits (a sentence).

    Returns:
        The placement, a reason to wait (a site is not connected, or lacks the resources now),
        or an `Impossible` reason (a site left the project).
    """
    gone = [site for site in record.sites if site not in known_sites]
    if gone or not record.sites:
        return Impossible(f"it ran on {', '.join(gone) or 'no site'}, no longer a site of the project")
    missing = [site for site in record.sites if site not in connected]
    if missing:
        return f"waiting for {', '.join(missing)} to connect, to resume it where it ran"
    placement = place(job, {site: connected[site] for site in record.sites}, known_sites)
    if isinstance(placement, str):
        return placement
    if set(placement.sites) != set(record.sites):
        return f"waiting for the sites it ran on ({', '.join(record.sites)}) to fit it again"
    return Placement(tuple(record.sites), placement.takes)
