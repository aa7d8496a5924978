"""FOBS decomposers of the model layer's types, registered by `register_model_types`."""

from __future__ import annotations

from typing import Any

from engine.fobs import DecodeContext, Decomposer, EncodeContext, Registry
from engine.model.dxo import DXO, DataKind
from engine.model.fl_model import FLModel, ParamsType
from engine.model.shareable import ReturnCode, Shareable


class FLModelDecomposer(Decomposer[FLModel]):
    """`FLModel` by its fields; its params' tensors go through their own decomposers."""

    def supported_type(self) -> type[FLModel]:
        return FLModel

    def wire_name(self) -> str:
        return "flengine.FLModel"

    def decompose(self, obj: FLModel, ctx: EncodeContext) -> Any:
        # meta first: a receiver may act on it (e.g. the result's weight) before the params land.
        return {
            "meta": obj.meta,
            "params_type": obj.params_type,
            "metrics": obj.metrics,
            "current_round": obj.current_round,
            "total_rounds": obj.total_rounds,
            "start_round": obj.start_round,
            "params": obj.params,
        }

    def recompose(self, data: Any, ctx: DecodeContext) -> FLModel:
        return FLModel(**data)


class ShareableDecomposer(Decomposer[Shareable]):
    """`Shareable` as a plain dict of its items (headers included)."""

    def supported_type(self) -> type[Shareable]:
        return Shareable

    def wire_name(self) -> str:
        return "flengine.Shareable"

    def decompose(self, obj: Shareable, ctx: EncodeContext) -> Any:
        return dict(obj)

    def recompose(self, data: Any, ctx: DecodeContext) -> Shareable:
        return Shareable(data)


class DXODecomposer(Decomposer[DXO]):
    """`DXO` as ``[data_kind, meta, data]``."""

    def supported_type(self) -> type[DXO]:
        return DXO

    def wire_name(self) -> str:
        return "flengine.DXO"

    def decompose(self, obj: DXO, ctx: EncodeContext) -> Any:
        return [obj.data_kind, obj.meta, obj.data]

    def recompose(self, data: Any, ctx: DecodeContext) -> DXO:
        data_kind, meta, payload = data
        if not isinstance(data_kind, DataKind):
            raise ValueError(f"DXO data kind must be a DataKind, got {data_kind!r}")
        return DXO(data_kind, payload, meta)


def register_model_types(registry: Registry) -> None:
    """Register the model layer's types (and their enums) in ``registry``."""
    for decomposer in (FLModelDecomposer(), ShareableDecomposer(), DXODecomposer()):
        registry.register(decomposer)
    for enum_type in (ParamsType, DataKind, ReturnCode):
        registry.register_enum(enum_type)
