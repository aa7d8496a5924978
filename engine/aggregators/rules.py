"""`ResultRules`: what a workflow checks in every result before it counts (values finite, metrics plausible).

A site with a valid key can still send NaNs, an accuracy of 1e9 or a metric named with terminal
escape codes. The workflows (FedAvg, ScatterAndGather, Swarm's aggregation client, cross-site
evaluation) apply one `ResultRules` to every result: a result with a non-finite value is refused
(that site's contribution alone, the round goes on), a metric that is not a finite number inside
the range the job declares (or its default range, `default_metric_range`), or whose name is not a
plain identifier, is dropped and logged; only accepted metrics are averaged and can make a model
the "best", and only when more than one site's value went into them (`metrics_from_one_site`).
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from engine.aggregators.check import check_finite
from engine.errors import ResultRefused
from engine.metric_ranges import default_metric_range
from engine.model import DXO, DataKind, FLModel, MetaKey, Shareable, shown_round

logger = logging.getLogger(__name__)

#: What a metric's name may look like: it is printed on consoles and written into reports, so
#: nothing a terminal would act on, and short.
METRIC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/@+-]{0,127}")


def check_metric_ranges(ranges: Mapping[str, Any] | None) -> dict[str, tuple[float, float]]:
    """Return the ``metric_ranges`` arg as name -> (low, high), checked.

    Raises:
        ValueError: A name is not a plain metric name, or a range is not two finite numbers with
            low <= high; the message names the entry.
    """
    checked = {}
    for name, bounds in dict(ranges or {}).items():
        if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
            raise ValueError(f"metric_ranges: {name!r} is not a metric name (letters, digits, _ . : / @ + -)")
        if (
            not isinstance(bounds, (list, tuple))
            or len(bounds) != 2
            or not all(_is_real(b) and math.isfinite(b) for b in bounds)
            or bounds[0] > bounds[1]
        ):
            raise ValueError(f"metric_ranges.{name}: expected [low, high] with finite low <= high, got {bounds!r}")
        checked[name] = (float(bounds[0]), float(bounds[1]))
    return checked


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class ResultRules:
    """The checks every result of a workflow goes through before it counts.

    Attributes:
        allow_non_finite: Accept NaN and infinite values in results (off: such a result is refused).
        metric_ranges: Metric name -> (low, high): a reported value outside is dropped. A metric
            the job gives no range to is checked against its default (`default_metric_range`).

    With every metric bounded, one site among n moves a round's weighted mean by at most its
    weight's share of the range (and honest values, inside it, count exactly as before).
    """

    allow_non_finite: bool = False
    metric_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def from_args(cls, allow_non_finite: bool = False, metric_ranges: Mapping[str, Any] | None = None) -> ResultRules:
        """Rules from a workflow's args, checked (raises ValueError naming the bad arg)."""
        if not isinstance(allow_non_finite, bool):
            raise ValueError(f"allow_non_finite: expected true or false, got {allow_non_finite!r}")
        return cls(allow_non_finite, check_metric_ranges(metric_ranges))

    def check_values(self, params: Mapping[str, Any], contributor: str) -> None:
        """Refuse ``params`` holding a NaN or an infinity, unless allowed.

        Raises:
            ResultRefused: Some value is not finite (see `check_finite`).
        """
        if not self.allow_non_finite:
            check_finite(params, contributor)

    def check_dxo_result(self, shareable: Shareable, contributor: str, current_round: int | None) -> None:
        """Check the DXO a result carries, in place: values finite (refused otherwise), metrics filtered.

        A METRICS DXO's data are metrics: they are filtered like the ``metrics`` meta of any
        other DXO (see `accepted_metrics`).

        Raises:
            ResultRefused: The result carries no DXO, or a value is not finite.
        """
        try:
            dxo = DXO.from_shareable(shareable)
        except ValueError as e:
            raise ResultRefused(f"result of {contributor}: {e}") from e
        if dxo.data_kind == DataKind.METRICS:
            dxo.data = self.accepted_metrics(dxo.data, contributor, current_round)
        else:
            self.check_values(dxo.data, contributor)
        if "metrics" in dxo.meta:
            dxo.meta["metrics"] = self.accepted_metrics(dxo.meta["metrics"], contributor, current_round)

    def accepted_metrics(self, metrics: Any, contributor: str, current_round: int | None) -> dict[str, float]:
        """The metrics of a result that may count: plain names, finite numbers inside their ranges.

        Every metric left out is logged with the contributor, the round and why.
        """
        if metrics is None:
            return {}
        if not isinstance(metrics, Mapping):
            _drop(contributor, current_round, "metrics", f"expected a dict, got {type(metrics).__name__}")
            return {}
        accepted = {}
        for name, value in metrics.items():
            why = self._refusal(name, value)
            if why is None:
                accepted[name] = value
            else:
                _drop(contributor, current_round, name if isinstance(name, str) else repr(name), why)
        return accepted

    def range_of(self, name: str) -> tuple[float, float] | None:
        """The range ``name``'s values must lie in: the job's, else its default (`default_metric_range`)."""
        return self.metric_ranges.get(name) or default_metric_range(name)

    def _refusal(self, name: Any, value: Any) -> str | None:
        if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
            return "not a plain metric name"
        if not _is_real(value):
            return f"not a number ({type(value).__name__})"
        if not math.isfinite(value):
            return f"not finite ({value!r})"
        bounds = self.range_of(name)
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            whose = "the job's" if name in self.metric_ranges else "the default"
            return f"{value!r} is outside {whose} range [{bounds[0]:g}, {bounds[1]:g}]"
        return None


def metrics_from_one_site(counted: Mapping[str, Iterable[str]], job_clients: int) -> list[str]:
    """The metrics of a round whose value one site alone decided, in a job of several sites.

    A round can end with one usable result (``min_clients = 1`` and the other sites refused or
    dead, or the others' values of a metric dropped as out of range): its metric is then that
    site's word alone, and must not make the round's model the best one. A job with a single
    client has nobody to compare with: its metrics are never listed.

    Args:
        counted: Each site whose result counted in the round -> the names of its metrics that
            counted (after `ResultRules.accepted_metrics`).
        job_clients: How many clients the job has.

    Returns:
        The names reported by fewer than two of those sites, sorted.

    Example:
        >>> metrics_from_one_site({"site-1": ["accuracy", "loss"], "site-2": ["loss"]}, job_clients=3)
        ['accuracy']
    """
    if job_clients < 2:
        return []
    sites_per_metric = Counter(name for names in counted.values() for name in set(names))
    return sorted(name for name, sites in sites_per_metric.items() if sites < 2)


def marked_from_one_site(model: FLModel, names: list[str]) -> FLModel:
    """``model`` with ``names`` (its metrics one site alone decided) as its `MetaKey.METRICS_FROM_ONE_SITE` meta.

    The list replaces any the model carried (an older round's); with no names the key is left
    out. A persistor picks no best model by a metric so listed.
    """
    meta = {key: value for key, value in (model.meta or {}).items() if key != MetaKey.METRICS_FROM_ONE_SITE}
    if names:
        meta[MetaKey.METRICS_FROM_ONE_SITE] = list(names)
    return replace(model, meta=meta)


def _drop(contributor: str, current_round: int | None, name: str, why: str) -> None:
    logger.warning(
        "metric refused: contributor=%s round=%s metric=%r reason=%s",
        contributor,
        shown_round(current_round),
        name[:80],
        why,
    )
