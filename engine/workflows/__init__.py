"""Workflows: FedAvg and ScatterAndGather (server-controlled algorithms on the Controller API)."""

from engine.workflows.fedavg import FedAvg
from engine.workflows.model_controller import ModelController
from engine.workflows.scatter_and_gather import ScatterAndGather
from engine.workflows.shareable_generator import FullModelShareableGenerator, ShareableGenerator

__all__ = ["FedAvg", "FullModelShareableGenerator", "ModelController", "ScatterAndGather", "ShareableGenerator"]
