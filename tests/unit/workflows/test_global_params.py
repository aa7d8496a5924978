"""`update_global` gets the round's global weights in ``model.params`` (`RoundModelParams`), read only when asked for."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from engine.aggregators import resolve_value
from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.model import FLModel
from engine.persistors import PTFileModelPersistor
from engine.workflows import FedAvg
from engine.workflows.global_params import RoundModelParams
from tests.unit.workflows.test_fedavg import CLIENTS, Net, _capture, next_task, reply


class EMAFromModel(FedAvg):
    """The docs' moving average, written against ``model.params`` alone (no persistor call)."""

    def __init__(self, decay: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decay = decay
        self.seen: list[Any] = []

    def update_global(self, model: FLModel, update: FLModel, current_round: int, reference: dict[str, Any]) -> FLModel:
        self.seen.append(model.params)
        new = super().update_global(model, update, current_round, reference)
        for name, value in new.params.items():
            if value.is_floating_point():
                value.mul_(1 - self.decay).add_(resolve_value(model.params[name]), alpha=self.decay)
        return new


class Watching(FedAvg):
    """FedAvg that keeps what ``update_global`` was given."""

    seen: list[Any]

    def update_global(self, model: FLModel, update: FLModel, current_round: int, reference: dict[str, Any]) -> FLModel:
        self.seen = [*getattr(self, "seen", []), model.params]
        return super().update_global(model, update, current_round, reference)


def run_rounds(tmp_path: Path, workflow: FedAvg, rounds: int, values: tuple[float, float]) -> dict[str, torch.Tensor]:
    """Play ``rounds`` rounds in which site-1 and site-2 send ``values``; return the saved model."""
    queue = TaskQueue(CLIENTS)
    persistor = PTFileModelPersistor(model=Net())  # fc.weight = 1, fc.bias = 2
    persistor.use_workspace(tmp_path)
    workflow.bind(queue, context=JobContext(workspace=tmp_path, components={"persistor": persistor}))
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(workflow.run, errors), daemon=True)
    thread.start()
    try:
        for _ in range(rounds):
            for site, value in zip(CLIENTS, values, strict=True):
                task = next_task(queue, site)
                params = {"fc.weight": torch.full((3, 4), value), "fc.bias": torch.full((3,), value)}
                queue.submit(site, task.task_id, reply(params, 1))
        thread.join(10)
    finally:
        queue.end_run()
    assert errors == []
    return persistor.load_model().params


def test_update_global_reads_the_rounds_weights_from_model_params(tmp_path: Path) -> None:
    workflow = EMAFromModel(decay=0.5, num_clients=2, num_rounds=2)

    final = run_rounds(tmp_path, workflow, rounds=2, values=(1.0, 3.0))

    # Each round: 0.5 x old + 0.5 x mean (2.0). Weights 1 -> 1.5 -> 1.75, biases 2 -> 2 -> 2.
    assert torch.allclose(final["fc.weight"], torch.full((3, 4), 1.75))
    assert torch.allclose(final["fc.bias"], torch.full((3,), 2.0))
    assert all(isinstance(params, RoundModelParams) for params in workflow.seen)  # handed to the task, read back


def test_fedavgs_full_mean_never_reads_the_rounds_weights_back(tmp_path: Path) -> None:
    workflow = Watching(num_clients=2, num_rounds=2)

    final = run_rounds(tmp_path, workflow, rounds=2, values=(1.0, 3.0))

    assert torch.allclose(final["fc.weight"], torch.full((3, 4), 2.0))
    assert len(workflow.seen) == 2 and not any(params.is_read for params in workflow.seen)


def test_the_weights_are_read_once_on_first_access() -> None:
    reads: list[int] = []

    def read() -> dict[str, torch.Tensor]:
        reads.append(1)
        return {"w": torch.ones(2), "b": torch.zeros(1)}

    params = RoundModelParams(read)
    assert reads == [] and not params.is_read and "not read yet" in repr(params)

    assert list(params) == ["w", "b"] and len(params) == 2 and torch.equal(params["w"], torch.ones(2))
    assert dict(params).keys() == {"w", "b"}
    assert reads == [1] and params.is_read
