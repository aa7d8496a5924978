"""How an `FLModel` rides in a `Shareable`, and how a `Shareable` becomes an `FLModel` again.

Tasks and results always travel as `Shareable`. The FedAvg path puts the `FLModel` itself in
it (under `FLMODEL_KEY`); the ScatterAndGather path carries a `DXO`. `model_from_shareable`
reads either, so executors and filters need not care which workflow sent the task.
"""

from __future__ import annotations

from engine.model.dxo import DXO, DataKind
from engine.model.fl_model import FLModel, ParamsType
from engine.model.shareable import Shareable

#: Key of the `FLModel` in a `Shareable` made by `shareable_from_model`.
FLMODEL_KEY = "FLModel"


def shareable_from_model(model: FLModel) -> Shareable:
    """Wrap ``model`` in a new `Shareable` (the model is not copied)."""
    shareable = Shareable()
    shareable[FLMODEL_KEY] = model
    return shareable


def carries_model(shareable: Shareable) -> bool:
    """Whether ``shareable`` carries an `FLModel` (rather than a DXO or nothing)."""
    return isinstance(shareable.get(FLMODEL_KEY), FLModel)


def model_from_shareable(shareable: Shareable) -> FLModel:
    """The `FLModel` a `Shareable` carries, or one built from the `DXO` it carries.

    A DXO of kind WEIGHTS or WEIGHT_DIFF becomes the params (FULL or DIFF), METRICS becomes the
    metrics; the DXO's meta becomes the model's meta.

    Raises:
        ValueError: The shareable carries neither an FLModel nor a DXO of those kinds.
    """
    model = shareable.get(FLMODEL_KEY)
    if isinstance(model, FLModel):
        return model
    dxo = DXO.from_shareable(shareable)
    if dxo.data_kind is DataKind.WEIGHTS:
        return FLModel(params=dxo.data, params_type=ParamsType.FULL, meta=dict(dxo.meta))
    if dxo.data_kind is DataKind.WEIGHT_DIFF:
        return FLModel(params=dxo.data, params_type=ParamsType.DIFF, meta=dict(dxo.meta))
    if dxo.data_kind is DataKind.METRICS:
        return FLModel(metrics=dxo.data, meta=dict(dxo.meta))
    raise ValueError(f"a DXO of kind {dxo.data_kind.value} does not convert to an FLModel")


def dxo_from_model(model: FLModel) -> DXO:
    """The DXO that carries ``model`` on the ScatterAndGather path (params, else metrics)."""
    meta = dict(model.meta)
    if model.params is not None:
        kind = DataKind.WEIGHT_DIFF if model.params_type is ParamsType.DIFF else DataKind.WEIGHTS
        if model.metrics:
            meta.setdefault("metrics", model.metrics)
        return DXO(kind, model.params, meta)
    return DXO(DataKind.METRICS, dict(model.metrics or {}), meta)
