"""The sites of a round: who was asked and what came back (`RoundTally`), waiting for enough live
sites (`wait_for_sites`), and live replacements for sites that died mid-round (`draw_replacements`).

A site is dead when the runtime says so (``JobContext.dead``: its job process ended, it sent no
heartbeat for the heartbeat timeout, or it was revoked); a dead site that asks for work again is
alive from then on.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.aggregators.rules import metrics_from_one_site
from engine.controller.context import JobContext
from engine.errors import WorkflowError

log = logging.getLogger(__name__)

#: How often a round left short of results by sites that died is played again (once enough are alive).
MAX_ROUND_RETRIES = 3


def check_site_wait_timeout(value: float) -> float:
    """``site_wait_timeout`` checked: a number of seconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"site_wait_timeout: expected a number of seconds >= 0, got {value!r}")
    return float(value)


@dataclasses.dataclass
class RoundTally:
    """Who a round asked and what came back, over the tasks of one attempt (the first and its replacements)."""

    asked: list[str]
    reference: dict[str, Any]
    accepted: list[str] = dataclasses.field(default_factory=list)
    replacements: list[str] = dataclasses.field(default_factory=list)
    failures: dict[str, str] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Sites that died holding a task of this attempt (some may be back already).
    died: set[str] = dataclasses.field(default_factory=set)
    #: Each accepted site -> the names of its metrics that counted (after the rules).
    metric_names: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def take_outcomes(
        self, failures: dict[str, str], refused: dict[str, str], errors: dict[str, str], died: set[str] = frozenset()
    ) -> None:
        """Add the last task's failures, refusals, errors and deaths (each task starts them anew)."""
        self.died.update(died)
        self.failures.update(failures)
        self.refused.update(refused)
        self.errors.update(errors)

    def metrics_from_one_site(self, job_clients: int) -> list[str]:
        """The round's metrics that one accepted site alone reported (see `metrics_from_one_site`)."""
        counted = {site: self.metric_names.get(site, []) for site in self.accepted}
        return metrics_from_one_site(counted, job_clients)

    def lost(self, dead: set[str]) -> list[str]:
        """Sites asked this round that are dead now, or died holding its task, and gave no usable result."""
        return [
            client for client in self.asked if (client in dead or client in self.died) and client not in self.accepted
        ]

    def site_fields(self, dead: dict[str, str]) -> dict[str, Any]:
        """The round's ``round_done`` fields about sites: the dead ones (with why) and the replacements, when any."""
        fields: dict[str, Any] = {}
        if dead:
            fields["dead"] = dict(sorted(dead.items()))
        if self.replacements:
            fields["replacements"] = list(self.replacements)
        return fields


def draw_replacements(
    context: JobContext,
    live: list[str],
    rng: random.Random,
    tally: RoundTally,
    count: int,
    current_round: int,
) -> list[str]:
    """Up to ``count`` of the ``live`` clients not asked this round, drawn with ``rng``, for sites that died in it.

    They are added to ``tally`` (``asked`` and ``replacements``) and reported (``round_replacements``).
    """
    lost = tally.lost(context.dead())
    candidates = [client for client in live if client not in tally.asked]
    if not lost or not candidates or count <= 0:
        return []
    drawn = sorted(rng.sample(candidates, min(count, len(candidates))))
    tally.asked.extend(drawn)
    tally.replacements.extend(drawn)
    log.warning("round %d: %s replaced by %s", current_round + 1, ", ".join(lost), ", ".join(drawn))
    context.report("round_replacements", round=current_round, lost=lost, drawn=drawn)
    return drawn


def wait_for_sites(
    context: JobContext,
    live_clients: Callable[[], list[str]],
    all_clients: int,
    needed: int,
    timeout_s: float,
    abort_signal: threading.Event,
    current_round: int,
) -> None:
    """Return once ``needed`` sites are alive (or the job is aborted), reporting the wait and its end.

    Raises:
        WorkflowError: Too few are alive for ``timeout_s`` seconds (``site_wait_timeout``); the
            message names the dead sites and why each is.
    """
    live = live_clients()
    if len(live) >= needed:
        return
    deadline = time.monotonic() + timeout_s
    dead = context.dead_reasons()
    log.warning(
        "round %d waits for sites: %d alive, %d needed, dead=%s timeout_s=%g",
        current_round + 1,
        len(live),
        needed,
        sorted(dead),
        timeout_s,
    )
    context.report("waiting_for_sites", round=current_round, alive=live, dead=dead, needed=needed, timeout_s=timeout_s)
    while len(live) < needed and not abort_signal.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            named = ", ".join(f"{site} ({why})" for site, why in sorted(context.dead_reasons().items()))
            raise WorkflowError(
                f"round {current_round + 1}: {len(live)} of {all_clients} sites alive, {needed} needed "
                f"(min_clients); dead: {named or 'none'}; none came back within {timeout_s:g} s (site_wait_timeout)"
            )
        abort_signal.wait(min(0.2, left))
        live = live_clients()
    if not abort_signal.is_set():
        context.report("sites_back", round=current_round, alive=live)
