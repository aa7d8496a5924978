"""The aggregator roles: `Aggregator` (Shareable results) and `ModelAggregator` (FLModel results).

`Aggregator` serves the ScatterAndGather path, where results are Shareables carrying a DXO;
`ModelAggregator` the FedAvg path, where results are `FLModel`s. `WeightedModelAggregator` is
the default of the latter: a weighted mean by each client's number of local steps.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from engine.aggregators.weighted import WeightedAggregationHelper, release_values
from engine.errors import ResultRefused
from engine.model import FLModel, MetaKey, ParamsType, Shareable

logger = logging.getLogger(__name__)


class Aggregator(ABC):
    """Accepts client results one by one and folds them into one result per round.

    Example:
        A minimal aggregator that keeps the last result::

            class KeepLast(Aggregator):
                def accept(self, shareable: Shareable, contributor: str, current_round: int) -> bool:
                    self._last = shareable
                    return True

                def aggregate(self, current_round: int) -> Shareable:
                    return self._last

                def reset(self) -> None:
                    self._last = Shareable()
    """

    @abstractmethod
    def accept(self, shareable: Shareable, contributor: str, current_round: int) -> bool:
        """Take ``contributor``'s result for ``current_round``; False (and a log line) if refused."""

    @abstractmethod
    def aggregate(self, current_round: int) -> Shareable:
        """Return the aggregate of the results accepted for ``current_round``."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every accepted result."""

    def start_round(  # noqa: B027 - optional hook, nothing to do by default
        self, current_round: int, load_global: Callable[[], Mapping[str, Any]]
    ) -> None:
        """Called by the workflow before a round's first result arrives (see `ModelAggregator.start_round`)."""


class ModelAggregator(ABC):
    """Accepts `FLModel` results one by one and folds them into one `FLModel` (the FedAvg path).

    Example:
        A minimal aggregator that keeps the first model::

            class KeepFirst(ModelAggregator):
                def __init__(self) -> None:
                    self._first: FLModel | None = None

                def accept_model(self, model: FLModel, contributor: str) -> None:
                    self._first = self._first or model

                def aggregate_model(self) -> FLModel:
                    return self._first

                def reset_stats(self) -> None:
                    self._first = None
    """

    @abstractmethod
    def accept_model(self, model: FLModel, contributor: str) -> None:
        """Take ``contributor``'s result.

        Raises:
            ResultRefused: It cannot be aggregated (the site's result alone is refused); anything
                else raised is taken for a bug in the aggregator (the result fails, with its traceback).
        """

    @abstractmethod
    def aggregate_model(self) -> FLModel:
        """Return the aggregate of the accepted models."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Forget every accepted model."""

    def start_round(  # noqa: B027 - optional hook, nothing to do by default
        self, current_round: int, load_global: Callable[[], Mapping[str, Any]]
    ) -> None:
        """Called by the workflow before a round's first result arrives.

        Args:
            current_round: The round that starts.
            load_global: Gives the global model's params the clients were sent this round
                (name -> tensor, read from the persistor on each call: call it only when the
                aggregation needs them, e.g. to clip updates of FULL results).
        """


def check_aggregation_weights(aggregation_weights: dict[str, float] | None) -> dict[str, float]:
    """Return ``aggregation_weights`` as a dict, checked: client name -> finite number >= 0.

    Raises:
        ValueError: A weight is not a finite number >= 0; the message names the client.
    """
    weights = dict(aggregation_weights or {})
    for name, weight in weights.items():
        if not _is_weight(weight):
            raise ValueError(f"aggregation_weights.{name}: expected a finite number >= 0, got {weight!r}")
    return weights


def _is_weight(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


#: The most local steps a result may claim by default (its ``NUM_STEPS_CURRENT_ROUND``, its
#: weight): far above what a real round trains, low enough that one lying site cannot drown the
#: others' results. A job whose clients really train more per round raises ``max_local_steps``.
DEFAULT_MAX_LOCAL_STEPS = 1_000_000


def check_max_local_steps(value: Any) -> float:
    """Return the ``max_local_steps`` arg as a float, checked: a finite number > 0.

    Raises:
        ValueError: It is not a finite number > 0.
    """
    if not _is_weight(value) or value == 0:
        raise ValueError(f"max_local_steps: expected a finite number > 0, got {value!r}")
    return float(value)


def local_steps(meta: dict[str, Any], contributor: str, maximum: float = DEFAULT_MAX_LOCAL_STEPS) -> float:
    """The contributor's ``NUM_STEPS_CURRENT_ROUND`` meta as a weight; 1.0 (and a warning) when absent.

    A weight is a claim of the contributor: it must be a finite number above 0 and at most
    ``maximum``, so that a site cannot make its result outweigh every other one.

    Raises:
        ResultRefused: The meta value is not a finite number in (0, ``maximum``]; the message
            names the contributor and the arg that raises the bound.
    """
    steps = meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND)
    if steps is None:
        logger.warning(
            "result has no %s meta, weighted 1.0: contributor=%s", MetaKey.NUM_STEPS_CURRENT_ROUND, contributor
        )
        return 1.0
    if not _is_weight(steps) or steps == 0:
        raise ResultRefused(
            f"result of {contributor}: meta {MetaKey.NUM_STEPS_CURRENT_ROUND} must be a finite number > 0, "
            f"got {steps!r}"
        )
    if steps > maximum:
        raise ResultRefused(
            f"result of {contributor}: meta {MetaKey.NUM_STEPS_CURRENT_ROUND} = {steps!r} is above the "
            f"aggregator's max_local_steps = {maximum:g}; raise max_local_steps in the aggregator's args if "
            "clients really train that many steps in a round"
        )
    return float(steps)


class WeightedModelAggregator(ModelAggregator):
    """Weighted mean of the accepted models' params and metrics (FedAvg).

    A model's weight is its ``meta["NUM_STEPS_CURRENT_ROUND"]`` (1.0 with a warning when absent;
    1.0 always when ``weigh_by_local_iter`` is False) times ``aggregation_weights.get(contributor,
    1.0)``. All models must have the same ``params_type``: the result is FULL for FULL inputs,
    DIFF for DIFF. Numeric metrics are averaged with the same weights; others are skipped. After a
    model is added, its lazy values' ``release()`` is called (see `release_values`).

    Args:
        exclude_vars: Regex of param names left out of the aggregate; None keeps all.
        aggregation_weights: Client name -> extra weight factor (default 1.0 for each).
        weigh_by_local_iter: Whether to weight by ``NUM_STEPS_CURRENT_ROUND``.
        max_local_steps: The largest ``NUM_STEPS_CURRENT_ROUND`` a result may claim; a result
            above it (or at most 0) is refused.

    Example:
        >>> aggregator = WeightedModelAggregator(aggregation_weights={"site-2": 0.5})
        >>> aggregator.accept_model(FLModel(params={"w": torch.ones(1)}), "site-1")
        >>> aggregator.accept_model(FLModel(params={"w": torch.zeros(1)}), "site-2")
        >>> aggregator.aggregate_model().params["w"]  # (1 * 1 + 0 * 0.5) / 1.5
        tensor([0.6667])
    """

    def __init__(
        self,
        exclude_vars: str | None = None,
        aggregation_weights: dict[str, float] | None = None,
        weigh_by_local_iter: bool = True,
        max_local_steps: float = DEFAULT_MAX_LOCAL_STEPS,
    ) -> None:
        self._weights = check_aggregation_weights(aggregation_weights)
        self._weigh_by_local_iter = weigh_by_local_iter
        self._max_local_steps = check_max_local_steps(max_local_steps)
        self._params = WeightedAggregationHelper(exclude_vars=exclude_vars)
        self._metrics = WeightedAggregationHelper()
        self._lock = threading.Lock()
        self._params_type: ParamsType | None = None

    def accept_model(self, model: FLModel, contributor: str) -> None:
        """Add ``model`` to the running weighted sum.

        Raises:
            ResultRefused: The model has no params, its params type differs from the accepted ones',
                its weight is invalid, it was already accepted, or a tensor does not fit the sum.
        """
        if model.params is None:
            raise ResultRefused(f"result of {contributor} carries no params; nothing to aggregate")
        weight = self._weights.get(contributor, 1.0)
        if self._weigh_by_local_iter:
            weight *= local_steps(model.meta, contributor, self._max_local_steps)
        metrics = numeric_metrics(model.metrics, contributor)
        params_type = ParamsType(model.params_type)
        contribution_round = model.current_round if model.current_round is not None else -1
        with self._lock:
            if self._params_type is not None and params_type is not self._params_type:
                raise ResultRefused(
                    f"result of {contributor} has {params_type.value} params but the accepted ones are "
                    f"{self._params_type.value}; all results of a round must be of one type"
                )
            self._params.add(model.params, weight, contributor, contribution_round)
            self._params_type = params_type
            if metrics:
                self._metrics.add(metrics, weight, contributor, contribution_round)
        release_values(model.params)

    def aggregate_model(self) -> FLModel:
        """Return the weighted mean as an `FLModel` and forget the accepted models.

        The result has ``meta == {"nr_aggregated": n}``; its metrics are None when no accepted
        model had numeric metrics.

        Raises:
            RuntimeError: No model was accepted.
        """
        with self._lock:
            count = self._params.get_len()
            params_type = self._params_type
            params = self._params.get_result()
            metrics = self._metrics.get_result() if self._metrics.get_len() else None
            self._reset()
        logger.info("models aggregated: nr_aggregated=%d params_type=%s", count, _type_name(params_type))
        return FLModel(params=params, params_type=params_type, metrics=metrics, meta={"nr_aggregated": count})

    def reset_stats(self) -> None:
        """Forget every accepted model."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._params.reset_stats()
        self._metrics.reset_stats()
        self._params_type = None


def _type_name(params_type: ParamsType | None) -> str:
    return params_type.value if params_type is not None else "None"


def numeric_metrics(metrics: Any, contributor: str) -> dict[str, Any]:
    """The numeric entries of a result's metrics (the ones a weighted mean applies to); others logged."""
    if not isinstance(metrics, dict):
        return {}
    numeric = {k: v for k, v in metrics.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}
    if len(numeric) < len(metrics):
        skipped = sorted(set(metrics) - set(numeric))
        logger.warning("non-numeric metrics not aggregated: contributor=%s names=%s", contributor, skipped)
    return numeric
