"""Workflows: FedAvg, FedOpt, Scaffold and ScatterAndGather (server-side algorithms on one `RoundLoop`)."""

from engine.workflows.fedavg import FedAvg
from engine.workflows.fedopt import FedOpt
from engine.workflows.model_controller import ModelController
from engine.workflows.round_loop import RoundLoop
from engine.workflows.scaffold import Scaffold
from engine.workflows.scatter_and_gather import ScatterAndGather
from engine.workflows.shareable_generator import FullModelShareableGenerator, ShareableGenerator

__all__ = [
    "FedAvg",
    "FedOpt",
    "FullModelShareableGenerator",
    "ModelController",
    "RoundLoop",
    "Scaffold",
    "ScatterAndGather",
    "ShareableGenerator",
]
