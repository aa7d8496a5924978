"""`ModelController.send_model_and_wait` with ``release_after_send``: once every target has been
sent the model, nobody on the server holds its tensors while the clients train."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import torch

from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.model import FLModel, ReturnCode
from engine.model.convert import shareable_from_model
from engine.workflows import ModelController

CLIENTS = ["site-1", "site-2"]


class OneRound(ModelController):
    """Sends a model it lets go of, and keeps the results."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params: dict[str, torch.Tensor] | None = params
        self.results: list[FLModel] = []

    def run(self) -> None:
        self.results = self.send_model_and_wait(data=self._model(), release_after_send=True)

    def _model(self) -> FLModel:
        params, self.params = self.params, None  # handed over: this workflow keeps no reference
        return FLModel(params=params)


def _next_task(queue: TaskQueue, client: str):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assignment = queue.next_task(client)
        if assignment is not None:
            return assignment
        time.sleep(0.01)
    raise AssertionError(f"{client} got no task")


def test_the_model_sent_is_let_go_once_every_target_has_it(tmp_path: Path) -> None:
    tensor = torch.ones(1000)
    watched = weakref.ref(tensor)
    workflow = OneRound({"w": tensor})
    del tensor
    queue = TaskQueue(CLIENTS)
    workflow.bind(queue, context=JobContext(workspace=tmp_path))
    thread = threading.Thread(target=workflow.run, daemon=True)
    thread.start()

    tasks = {client: _next_task(queue, client) for client in CLIENTS}
    task_ids = {client: task.task_id for client, task in tasks.items()}
    del tasks  # the runtime has encoded the task for both and let go of it
    gc.collect()
    held_while_training = watched() is not None
    for client, task_id in task_ids.items():
        result = shareable_from_model(FLModel(params={"w": torch.zeros(1000)}))
        result.set_return_code(ReturnCode.OK)
        queue.submit(client, task_id, result)
    thread.join(10)
    queue.end_run()

    assert not held_while_training
    assert [model.meta["client_name"] for model in workflow.results] == CLIENTS
