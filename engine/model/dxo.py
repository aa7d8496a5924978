"""`DXO`: a data exchange object, the typed payload of a `Shareable` on the ScatterAndGather path."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine.model.shareable import Shareable

_DXO_KEY = "DXO"


class DataKind(str, Enum):
    """What a DXO's data holds."""

    WEIGHTS = "WEIGHTS"
    WEIGHT_DIFF = "WEIGHT_DIFF"
    METRICS = "METRICS"
    COLLECTION = "COLLECTION"


class MetaKey:
    """Well-known keys of ``DXO.meta`` and ``FLModel.meta`` (plain strings, usable as dict keys)."""

    NUM_STEPS_CURRENT_ROUND = "NUM_STEPS_CURRENT_ROUND"
    INITIAL_METRICS = "initial_metrics"
    VALIDATION_METRICS = "validation_metrics"
    #: Names of the model's metrics whose value one site alone decided, in a job of several
    #: sites (`engine.aggregators.rules.metrics_from_one_site`): never used to pick a best model.
    METRICS_FROM_ONE_SITE = "metrics_from_one_site"


@dataclass
class DXO:
    """Typed data with its own meta, carried inside a `Shareable`.

    Attributes:
        data_kind: What ``data`` holds.
        data: Name -> tensor/array for weights, name -> value for metrics, name -> DXO for a
            collection.
        meta: e.g. ``{MetaKey.NUM_STEPS_CURRENT_ROUND: 100}``.
    """

    data_kind: DataKind
    data: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_shareable(self) -> Shareable:
        """Wrap this DXO in a new `Shareable`."""
        shareable = Shareable()
        shareable[_DXO_KEY] = self
        return shareable

    @staticmethod
    def from_shareable(shareable: Shareable) -> DXO:
        """Return the DXO a `Shareable` carries.

        Raises:
            ValueError: The shareable carries no DXO.
        """
        dxo = shareable.get(_DXO_KEY)
        if not isinstance(dxo, DXO):
            raise ValueError("the shareable carries no DXO (was it made with DXO.to_shareable()?)")
        return dxo
