"""Stand-ins for engine classes that do not exist yet (issue 3 allows this, documented here).

Each class takes exactly the constructor arguments of the engine class it stands for, so
`flengine validate jobs/fedavg` checks the job's config for real. They do nothing else and are
deleted when the runtime issue brings ``engine.workflows.FedAvg``,
``engine.persistors.PTFileModelPersistor`` and ``engine.executors.ClientAPIExecutor``.
"""

from __future__ import annotations

from typing import Literal

from torch import nn


class FedAvg:
    """Stand-in for ``engine.workflows.FedAvg``: records its arguments."""

    def __init__(
        self,
        num_clients: int,
        num_rounds: int,
        start_round: int = 0,
        persistor_id: str = "persistor",
        aggregation_weights: dict[str, float] | None = None,
        download_to_disk: bool = False,
    ) -> None:
        self.num_clients = num_clients
        self.num_rounds = num_rounds
        self.start_round = start_round
        self.persistor_id = persistor_id
        self.aggregation_weights = aggregation_weights or {}
        self.download_to_disk = download_to_disk


class PTFileModelPersistor:
    """Stand-in for ``engine.persistors.PTFileModelPersistor``: holds the model it is given."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model


class ClientAPIExecutor:
    """Stand-in for ``engine.executors.ClientAPIExecutor``: records its arguments."""

    def __init__(
        self,
        task_script_path: str,
        task_script_args: str = "",
        execution_mode: Literal["in_process", "subprocess"] = "in_process",
    ) -> None:
        self.task_script_path = task_script_path
        self.task_script_args = task_script_args
        self.execution_mode = execution_mode
