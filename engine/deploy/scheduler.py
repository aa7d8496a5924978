"""Which sites a submitted job runs on, and whether it can start now.

A job names its sites in ``deploy_map`` (an app for ``site-1`` and ``site-2``, or ``@ALL``) and
how many it needs in ``min_clients``; ``resource_spec`` says what it takes of each site
(``{ site-1 { num_gpus = 1 } }``). A site declares what it has in the project file
(``resources { num_gpus = 2 }``). A job starts when every site it names is connected (with
``@ALL``: at least ``min_clients`` sites are), and what it asks of each site fits in what the
site declared minus what the site's running jobs take. Jobs start in the order they were
submitted; a job that cannot start yet does not hold back the jobs behind it whose sites are
free (so one job waiting for a site that is down does not stop the others).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from engine.config import Job
from engine.config.job import ALL_SITES

SERVER = "server"


class Impossible(str):
    """Why a job can never run as submitted (it is refused, not queued): a reason, as a string."""


@dataclasses.dataclass(frozen=True)
class SiteState:
    """A connected site as the scheduler sees it.

    Attributes:
        name: The site's identity.
        resources: What the site declared in the project file (name -> amount).
        taken: What the jobs running there take now (name -> amount).
    """

    name: str
    resources: Mapping[str, Any]
    taken: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a job runs: its client sites, and what it takes of each."""

    sites: tuple[str, ...]
    takes: Mapping[str, Mapping[str, float]]


def place(job: Job, connected: Mapping[str, SiteState], known_sites: Sequence[str]) -> Placement | str:
    """Where ``job`` can run now, or why it cannot yet (a sentence for ``status``).

    Args:
        job: The job, loaded from the store.
        connected: The sites connected now, by name.
        known_sites: Every site of the project (a job naming another one can never run).

    Returns:
        A `Placement`; the reason the job waits (a str); or, when it can never run as
        submitted (a resource amount that is not a number, fewer named sites than
        ``min_clients``), an `Impossible` reason.
    """
    wanted = _named_sites(job)
    everyone = wanted is None
    spec = job.meta.data.get("resource_spec", {})
    for site, asked in spec.items():
        for key, amount in asked.items():
            if not _is_amount(amount):
                return Impossible(f"resource_spec {site}.{key} = {amount!r} is not a number >= 0")
    if not everyone and len(wanted) < job.min_clients:
        return Impossible(f"deploy_map names {len(wanted)} client sites, fewer than min_clients = {job.min_clients}")
    unknown = [] if everyone else [site for site in wanted if site not in known_sites]
    if unknown:
        return f"deploy_map names sites that are not in the project: {', '.join(unknown)}"
    sites = sorted(connected) if everyone else list(wanted)
    missing = [site for site in sites if site not in connected]
    if missing:
        return f"waiting for {', '.join(missing)} to connect"
    takes: dict[str, dict[str, float]] = {}
    short: list[str] = []
    for site in sites:
        asked = spec.get(site, {})
        reason = _does_not_fit(connected[site], asked)
        if reason is None:
            takes[site] = {key: float(value) for key, value in asked.items()}
        elif everyone:
            short.append(f"{site}: {reason}")
        else:
            return f"waiting for resources: {site}: {reason}"
    chosen = [site for site in sites if site in takes]
    if len(chosen) < job.min_clients:
        detail = f" ({'; '.join(short)})" if short else ""
        return f"waiting for clients: {len(chosen)} of min_clients = {job.min_clients} can take it now{detail}"
    return Placement(tuple(chosen), takes)


def _named_sites(job: Job) -> list[str] | None:
    """The client sites ``deploy_map`` names, in order; None when it says ``@ALL``."""
    named: list[str] = []
    for sites in job.meta.data["deploy_map"].values():
        if ALL_SITES in sites:
            return None
        named.extend(site for site in sites if site != SERVER and site not in named)
    return named


def _does_not_fit(site: SiteState, asked: Mapping[str, Any]) -> str | None:
    for key, amount in asked.items():
        declared = site.resources.get(key)
        if not _is_amount(declared):
            return f"it declares no {key}"
        free = float(declared) - site.taken.get(key, 0.0)
        if float(amount) > free:
            return f"{key}: asks {amount:g}, {free:g} of {float(declared):g} free"
    return None


def _is_amount(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0
