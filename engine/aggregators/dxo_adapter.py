"""The two aggregator roles, each usable as the other.

`ModelAggregatorAsDXO`: any `ModelAggregator` (median, trimmed mean, Krum, clipping) as an
`Aggregator` of DXO results, for a ScatterAndGather config. `DXOAggregatorAsModel`: any DXO
`Aggregator` as a `ModelAggregator`, the one interface the workflows' round loop speaks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from engine.aggregators.aggregator import Aggregator, ModelAggregator
from engine.aggregators.dxo_aggregator import acceptable_dxo
from engine.errors import ResultRefused
from engine.model import (
    DXO,
    DataKind,
    FLModel,
    ParamsType,
    ReservedHeaderKey,
    ReturnCode,
    Shareable,
    dxo_from_model,
    model_from_shareable,
    shown_round,
)

logger = logging.getLogger(__name__)

_PARAMS_TYPES = {DataKind.WEIGHTS: ParamsType.FULL, DataKind.WEIGHT_DIFF: ParamsType.DIFF}


class ModelAggregatorAsDXO(Aggregator):
    """Lets the ScatterAndGather workflow use a `ModelAggregator` (median, trimmed mean, Krum, clipping).

    Each result's DXO becomes an `FLModel` (WEIGHTS: FULL params, WEIGHT_DIFF: DIFF params; the
    DXO's meta as the model's meta, its ``metrics`` meta as the metrics) and goes to the wrapped
    aggregator; the aggregate goes back as a DXO of ``expected_data_kind`` whose meta holds
    ``nr_aggregated``, ``current_round``, ``metrics`` and what the wrapped aggregator adds (e.g.
    Krum's ``selected``). `start_round` is forwarded.

    A result is refused (``accept`` returns False and logs why) when its return code is not OK,
    its ``current_round`` header names another round, it carries no DXO or one of another kind
    than ``expected_data_kind``, or the wrapped aggregator refuses it (`ResultRefused`; anything
    else it raises is a bug, and is raised).

    Args:
        aggregator: The `ModelAggregator` to wrap; in a config, a nested component.
        expected_data_kind: ``"WEIGHTS"`` or ``"WEIGHT_DIFF"``.

    Example:
        In ``config_fed_server.conf``, the component ScatterAndGather's ``aggregator_id`` names::

            { id = aggregator, path = engine.aggregators.ModelAggregatorAsDXO,
              args { expected_data_kind = WEIGHT_DIFF,
                     aggregator { path = engine.aggregators.TrimmedMeanAggregator, args { trim_fraction = 0.2 } } } }
    """

    def __init__(self, aggregator: ModelAggregator, expected_data_kind: str = "WEIGHT_DIFF") -> None:
        if not isinstance(aggregator, ModelAggregator):
            raise TypeError(
                f"aggregator: expected a ModelAggregator, e.g. {{ path = engine.aggregators.TrimmedMeanAggregator, "
                f"args {{ trim_fraction = 0.2 }} }}, got {type(aggregator).__name__}"
            )
        kinds = ", ".join(kind.value for kind in _PARAMS_TYPES)
        try:
            kind = DataKind(expected_data_kind)
        except ValueError as e:
            raise ValueError(f"expected_data_kind: expected one of {kinds}, got {expected_data_kind!r}") from e
        if kind not in _PARAMS_TYPES:
            raise ValueError(f"expected_data_kind: expected one of {kinds}, got {expected_data_kind!r}")
        self._aggregator = aggregator
        self._kind = kind

    @property
    def aggregator(self) -> ModelAggregator:
        """The wrapped aggregator."""
        return self._aggregator

    @property
    def expected_data_kind(self) -> DataKind:
        """The kind of DXO this aggregator accepts and returns."""
        return self._kind

    def start_round(self, current_round: int, load_global: Callable[[], Mapping[str, Any]]) -> None:
        """Forwarded to the wrapped aggregator."""
        self._aggregator.start_round(current_round, load_global)

    def accept(self, shareable: Shareable, contributor: str, current_round: int) -> bool:
        """Give ``contributor``'s result for ``current_round`` to the wrapped aggregator; False (logged) if refused."""
        try:
            dxo = acceptable_dxo(shareable, current_round, self._kind)
            metrics = dxo.meta.get("metrics")
            model = FLModel(
                params=dxo.data,
                params_type=_PARAMS_TYPES[self._kind],
                metrics=metrics if isinstance(metrics, dict) else None,
                meta=dict(dxo.meta),
                current_round=current_round,
            )
            self._aggregator.accept_model(model, contributor)
        except ResultRefused as e:
            shown = shown_round(current_round)
            logger.warning("result refused: contributor=%s round=%d reason=%s", contributor, shown, e)
            return False
        logger.info("result accepted: contributor=%s round=%d", contributor, shown_round(current_round))
        return True

    def aggregate(self, current_round: int) -> Shareable:
        """Return the wrapped aggregator's aggregate as a DXO of ``expected_data_kind`` in a Shareable.

        Raises:
            RuntimeError: As the wrapped aggregator's ``aggregate_model`` (e.g. too few results).
        """
        model = self._aggregator.aggregate_model()
        meta: dict[str, Any] = {**model.meta, "current_round": current_round}
        if model.metrics:
            meta["metrics"] = model.metrics
        return DXO(self._kind, dict(model.params or {}), meta).to_shareable()

    def reset(self) -> None:
        """Forget every accepted result (the wrapped aggregator's ``reset_stats``)."""
        self._aggregator.reset_stats()


class DXOAggregatorAsModel(ModelAggregator):
    """Any `Aggregator` of DXO results as a `ModelAggregator`: how the round loop, which speaks
    `FLModel` only, uses ScatterAndGather's aggregators (`DXOAggregator` and the user's own).

    Each result `FLModel` goes to the wrapped aggregator as the DXO it arrived as (FULL params:
    WEIGHTS, DIFF: WEIGHT_DIFF, metrics alone: METRICS; the model's meta as the DXO's meta) in a
    `Shareable` with return code OK and the round's ``current_round`` header; the aggregate
    `Shareable` comes back as an `FLModel` the same way (`model_from_shareable`). A result the
    wrapped aggregator refuses (``accept`` returns False; it logs why) raises `ResultRefused`.

    Args:
        aggregator: The `Aggregator` to wrap.

    Example:
        >>> adapter = DXOAggregatorAsModel(DXOAggregator(expected_data_kind="WEIGHTS"))
        >>> adapter.start_round(0, dict)
        >>> adapter.accept_model(FLModel(params={"w": torch.ones(1)}), "site-1")
        >>> adapter.aggregate_model().params["w"]
        tensor([1.])
    """

    def __init__(self, aggregator: Aggregator) -> None:
        if not isinstance(aggregator, Aggregator):
            raise TypeError(f"aggregator: expected an Aggregator, got {type(aggregator).__name__}")
        self._aggregator = aggregator
        self._round = 0

    @property
    def aggregator(self) -> Aggregator:
        """The wrapped aggregator."""
        return self._aggregator

    def start_round(self, current_round: int, load_global: Callable[[], Mapping[str, Any]]) -> None:
        """Remember the round (its results are given to the wrapped aggregator as of it); forwarded."""
        self._round = current_round
        self._aggregator.start_round(current_round, load_global)

    def accept_model(self, model: FLModel, contributor: str) -> None:
        """Give ``contributor``'s result to the wrapped aggregator as a DXO.

        Raises:
            ResultRefused: The wrapped aggregator refused it (its reason is in the server log).
        """
        shareable = dxo_from_model(model).to_shareable()
        shareable.set_return_code(ReturnCode.OK)
        shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, self._round)
        if not self._aggregator.accept(shareable, contributor, self._round):
            raise ResultRefused("refused by the aggregator (its reason is in the server log)")

    def aggregate_model(self) -> FLModel:
        """The wrapped aggregator's aggregate as an `FLModel`.

        Raises:
            ValueError: The aggregate is a DXO that holds no model or metrics (e.g. a COLLECTION).
        """
        return model_from_shareable(self._aggregator.aggregate(self._round))

    def reset_stats(self) -> None:
        """Forget every accepted result (the wrapped aggregator's ``reset``)."""
        self._aggregator.reset()
