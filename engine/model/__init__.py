"""The data that workflows and training scripts exchange: `FLModel`, `Shareable`, `DXO`.

Importing this package registers their FOBS decomposers in the default FOBS registry, so any
process that handles these types can send and receive them; `register_model_types` does the same
for another registry.
"""

from engine.fobs import default_registry
from engine.model.convert import FLMODEL_KEY, carries_model, dxo_from_model, model_from_shareable, shareable_from_model
from engine.model.decomposers import register_model_types
from engine.model.dxo import DXO, DataKind, MetaKey
from engine.model.fl_model import FLModel, ParamsType, shown_round
from engine.model.shareable import ReservedHeaderKey, ReturnCode, Shareable, make_reply

register_model_types(default_registry())

__all__ = [
    "DXO",
    "FLMODEL_KEY",
    "DataKind",
    "FLModel",
    "MetaKey",
    "ParamsType",
    "ReservedHeaderKey",
    "ReturnCode",
    "carries_model",
    "dxo_from_model",
    "Shareable",
    "make_reply",
    "model_from_shareable",
    "register_model_types",
    "shareable_from_model",
    "shown_round",
]
