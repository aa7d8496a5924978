"""The pieces of a Swarm round: gathering results at the aggregation client, and the models it moves."""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Collection
from typing import Any

from engine.aggregators import Aggregator, ResultRules
from engine.aggregators.refusals import bug_reason
from engine.aggregators.rules import metrics_from_one_site
from engine.errors import ResultRefused
from engine.model import DXO, DataKind, FLModel, ReturnCode, Shareable, shown_round
from engine.streaming.lazy import LazyRef, cleanup_lazy_refs

log = logging.getLogger(__name__)

#: Why a round has no result from a trainer the server lost for good.
LOST = "lost: the server judged it gone"


@dataclasses.dataclass(eq=False)
class RoundGathering:
    """One Swarm round at its aggregation client: who should send, who did, the round's model.

    Results are folded into the aggregator as they arrive (`take`); `wait_done` applies the
    round's exit rule: every trainer answered, or enough did and the extra wait passed, or the
    round timed out. Each trainer sends one result a round (`claim`).
    """

    number: int
    trainers: list[str]
    base: Shareable | None = None
    accepted: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.monotonic)
    closed: bool = False
    #: Set when the round's model never arrived whole (its sender was lost): nothing is aggregated.
    abandoned: bool = False
    #: Trainers that gave the round up (its model never reached them whole either).
    gave_up: set[str] = dataclasses.field(default_factory=set)
    claimed: set[str] = dataclasses.field(default_factory=set)
    #: How the round folds its results chunk by chunk (`engine.executors.ccwf.swarm_intake.RoundFold`);
    #: None: whole, into the swarm's aggregator.
    fold: Any = None
    #: Each accepted trainer -> the names of its metrics that counted (after the rules).
    metric_names: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: Set when the round closes or the job stops: pulls of its results still running then end.
    pulls_stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    _changed: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def set_base(self, data: Shareable) -> None:
        with self._changed:
            self.base = data
            self._changed.notify_all()

    def wait_base(self, stop: threading.Event, timeout_s: float) -> Shareable | None:
        """The round's model once it is here; None if it is not within ``timeout_s``, or ``stop`` is set."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (
                self.base is None
                and not self.closed
                and not self.abandoned
                and not stop.is_set()
                and time.monotonic() < deadline
            ):
                self._changed.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            return self.base

    def claim(self, site: str) -> bool:
        """Note that ``site`` sent its result; False when it already did, is not a trainer of the
        round, or is lost."""
        with self._changed:
            if site not in self.trainers or site in self.claimed or self.failed.get(site) == LOST:
                return False
            self.claimed.add(site)
            return True

    def lose(self, sites: Collection[str]) -> None:
        """Wait no longer for the results of ``sites`` (the server lost them), save those already coming."""
        with self._changed:
            for site in self.trainers:
                if site in sites and site not in self.claimed and site not in self.failed:
                    self.failed[site] = LOST
            self._changed.notify_all()

    def take(self, site: str, result: Shareable, aggregator: Aggregator, rules: ResultRules | None = None) -> None:
        """Check one trainer's result (``rules``) and fold it into the aggregator, or record why not."""
        if result.get_return_code() is not ReturnCode.OK:
            self.fail(site, f"return code {result.get_return_code().value}: {result.get_header('reason')}")
            return
        with self._changed:
            if self.closed or site in self.accepted:
                return
        try:
            (rules or ResultRules()).check_dxo_result(result, site, self.number)
        except ResultRefused as e:
            log.warning("result refused: site=%s round=%d reason=%s", site, shown_round(self.number), e)
            self.fail(site, str(e))
            return
        except Exception as e:  # a bug in a check: the result fails, the round goes on
            log.exception("result failed: site=%s round=%d", site, shown_round(self.number))
            self.fail(site, bug_reason(e))
            return
        if aggregator.accept(result, site, self.number):
            with self._changed:
                self.metric_names[site] = _metric_names(result)
                self.accepted.append(site)
                self._changed.notify_all()
        else:
            self.fail(site, "the aggregator refused it (see the log)")

    def metrics_from_one_site(self, job_clients: int) -> list[str]:
        """The round's metrics that one accepted trainer alone reported (see `metrics_from_one_site`)."""
        with self._changed:
            counted = {site: self.metric_names.get(site, []) for site in self.accepted}
        return metrics_from_one_site(counted, job_clients)

    def fail(self, site: str, why: str) -> None:
        with self._changed:
            if site not in self.accepted:
                self.failed[site] = why
            self._changed.notify_all()

    def drop(self, site: str, why: str) -> None:
        """Take back ``site``'s accepted result (its part of the sum had to go): it counts as failed."""
        with self._changed:
            if site in self.accepted:
                self.accepted.remove(site)
            self.failed[site] = why
            self._changed.notify_all()

    def given_up_by(self, site: str) -> None:
        """``site`` gave the round up (its model did not reach it whole): no result of it comes."""
        with self._changed:
            self.gave_up.add(site)
        self.fail(site, "it gave the round up: the round's model did not reach it whole")

    def abandon(self) -> list[str]:
        """Give the round up (its model never arrived whole): `wait_done` returns False, pulls end.

        Returns:
            The trainers whose result of the round came, or is coming, though they did not give it
            up: they had its model whole (the round's aggregation client has them drop the round).
        """
        with self._changed:
            self.abandoned = True
            self._changed.notify_all()
            had_it = sorted(self.claimed - self.gave_up)
        self.pulls_stop.set()
        return had_it

    def wait_done(self, minimum: int, wait_after_min_s: float, timeout_s: float, stopped: threading.Event) -> bool:
        """Wait for the round's model and its results; False when the job stopped or the round was abandoned."""
        min_reached_at = None
        with self._changed:
            while not stopped.is_set() and not self.abandoned:
                now = time.monotonic()
                answered = len(self.accepted) + len(self.failed)
                if len(self.accepted) >= minimum and min_reached_at is None:
                    min_reached_at = now
                if self.base is not None and (
                    answered >= len(self.trainers)
                    or (min_reached_at is not None and now - min_reached_at >= wait_after_min_s)
                ):
                    return True
                if now - self.started > timeout_s:
                    return True
                self._changed.wait(0.2)
        return False

    def release(self) -> None:
        """Drop the round's model (its downloaded files go with it)."""
        base, self.base = self.base, None
        cleanup_lazy_refs(base)


def _metric_names(result: Shareable) -> list[str]:
    """The names of a checked result's metrics: a METRICS DXO's data, and a DXO's ``metrics`` meta."""
    try:
        dxo = DXO.from_shareable(result)
    except ValueError:
        return []
    names = list(dxo.data) if dxo.data_kind is DataKind.METRICS else []
    in_meta = dxo.meta.get("metrics")
    return list(dict.fromkeys([*names, *(in_meta if isinstance(in_meta, dict) else {})]))


def private_copy(data: Shareable) -> Shareable:
    """``data`` with the tensors of its model copied: a model this client may change while it is served."""
    private = Shareable(data)
    for key, value in private.items():
        if isinstance(value, DXO):
            private[key] = dataclasses.replace(value, data=_cloned(value.data))
        elif isinstance(value, FLModel) and value.params is not None:
            private[key] = dataclasses.replace(value, params=_cloned(value.params))
    return private


def _cloned(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value.clone() if hasattr(value, "clone") else copy.deepcopy(value) for name, value in values.items()}


def in_memory(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with lazy refs read into memory, one tensor at a time."""
    return {name: value.resolve() if isinstance(value, LazyRef) else value for name, value in params.items()}
