"""Shareable generators: the ScatterAndGather path's conversion between the global model and a Shareable."""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.model import DXO, DataKind, FLModel, ParamsType, Shareable


class ShareableGenerator(ABC):
    """Turns the global model into task data and an aggregated result back into the global model."""

    @abstractmethod
    def learnable_to_shareable(self, model: FLModel) -> Shareable:
        """Task data for ``model``."""

    @abstractmethod
    def shareable_to_learnable(self, shareable: Shareable, base: FLModel) -> FLModel:
        """The new global model from an aggregated result and the current ``base`` model."""


class FullModelShareableGenerator(ShareableGenerator):
    """Sends the whole model as a DXO of WEIGHTS; applies WEIGHTS (replace) or WEIGHT_DIFF (add)."""

    def learnable_to_shareable(self, model: FLModel) -> Shareable:
        return DXO(DataKind.WEIGHTS, dict(model.params or {}), dict(model.meta)).to_shareable()

    def shareable_to_learnable(self, shareable: Shareable, base: FLModel) -> FLModel:
        dxo = DXO.from_shareable(shareable)
        params = dict(base.params or {})
        if dxo.data_kind is DataKind.WEIGHTS:
            params.update(dxo.data)
        elif dxo.data_kind is DataKind.WEIGHT_DIFF:
            for name, delta in dxo.data.items():
                params[name] = (
                    params[name] + delta.to(params[name].dtype) if hasattr(delta, "to") else params[name] + delta
                )
        else:
            raise ValueError(
                f"the aggregated result is a DXO of kind {dxo.data_kind.value}; expected WEIGHTS or WEIGHT_DIFF"
            )
        metrics = dxo.meta.get("metrics") if isinstance(dxo.meta.get("metrics"), dict) else base.metrics
        return FLModel(params=params, params_type=ParamsType.FULL, metrics=metrics, meta=dict(base.meta))
