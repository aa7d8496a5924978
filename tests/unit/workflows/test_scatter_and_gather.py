"""ScatterAndGather against a real task queue, the test playing three clients, two of them liars:
a refused result costs its site the round, never the job (whatever ``ignore_result_error`` says)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.aggregators import DXOAggregator, ModelAggregatorAsDXO, NormClippingAggregator
from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.errors import WorkflowError
from engine.model import DXO, DataKind, MetaKey, ReservedHeaderKey, ReturnCode
from engine.persistors import PTFileModelPersistor
from engine.workflows import FullModelShareableGenerator, ScatterAndGather

CLIENTS = ["site-1", "site-2", "site-3"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)


def _next_task(queue: TaskQueue, client: str):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assignment = queue.next_task(client)
        if assignment is not None:
            return assignment
        time.sleep(0.01)
    raise AssertionError(f"{client} got no task")


def _result(kind: DataKind, value: float, current_round: int, metrics: dict | None = None):
    data = {"fc.weight": torch.full((3, 4), value), "fc.bias": torch.full((3,), value)}
    meta = {MetaKey.NUM_STEPS_CURRENT_ROUND: 1, "metrics": metrics or {}}
    shareable = DXO(kind, data, meta).to_shareable()
    shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, current_round)
    shareable.set_return_code(ReturnCode.OK)
    return shareable


def test_liars_results_are_refused_and_the_round_goes_on_with_the_honest_one(tmp_path: Path) -> None:
    queue = TaskQueue(CLIENTS)
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(tmp_path)
    events: list[tuple[str, dict]] = []
    components = {
        "persistor": persistor,
        "aggregator": DXOAggregator(expected_data_kind="WEIGHTS"),
        "shareable_generator": FullModelShareableGenerator(),
    }
    workflow = ScatterAndGather(
        min_clients=1, num_rounds=1, wait_time_after_min_received=30, metric_ranges={"acc": [0, 1]}
    )
    workflow.bind(
        queue,
        context=JobContext(
            workspace=tmp_path, components=components, report=lambda event, **f: events.append((event, f))
        ),
    )
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(workflow.run, errors), daemon=True)
    thread.start()

    tasks = {client: _next_task(queue, client) for client in CLIENTS}
    queue.submit("site-1", tasks["site-1"].task_id, _result(DataKind.WEIGHTS, float("nan"), 0))  # NaN
    queue.submit("site-3", tasks["site-3"].task_id, _result(DataKind.WEIGHT_DIFF, 9.0, 0))  # wrong kind
    queue.submit("site-2", tasks["site-2"].task_id, _result(DataKind.WEIGHTS, 3.0, 0, {"acc": 0.5, "x": 1e9}))
    thread.join(10)

    assert errors == []
    assert torch.equal(persistor.load_model().params["fc.weight"], torch.full((3, 4), 3.0))
    done = [fields for event, fields in events if event == "round_done"]
    assert done[0]["clients"] == ["site-2"]
    assert sorted(done[0]["refused"]) == ["site-1", "site-3"]
    assert "holds NaN or infinite values" in done[0]["refused"]["site-1"]
    queue.end_run()


def _capture(function, errors: list[BaseException]) -> None:
    try:
        function()
    except BaseException as e:  # noqa: BLE001 - handed to the test
        errors.append(e)


def test_clipping_through_the_dxo_adapter_clips_full_results_from_the_first_round(tmp_path: Path) -> None:
    queue = TaskQueue(CLIENTS)
    net = Net()
    with torch.no_grad():
        net.fc.weight.fill_(1.0)
        net.fc.bias.fill_(1.0)
    persistor = PTFileModelPersistor(model=net)
    persistor.use_workspace(tmp_path)
    clip = ModelAggregatorAsDXO(NormClippingAggregator(max_norm=1.0), expected_data_kind="WEIGHTS")
    components = {"persistor": persistor, "aggregator": clip, "shareable_generator": FullModelShareableGenerator()}
    workflow = ScatterAndGather(min_clients=3, num_rounds=1, wait_time_after_min_received=30)
    workflow.bind(queue, context=JobContext(workspace=tmp_path, components=components))
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(workflow.run, errors), daemon=True)
    thread.start()

    tasks = {client: _next_task(queue, client) for client in CLIENTS}
    for client, value in (("site-1", 1.0), ("site-2", 1.0), ("site-3", 1001.0)):  # site-3 moves by +1000
        queue.submit(client, tasks[client].task_id, _result(DataKind.WEIGHTS, value, 0))
    thread.join(10)

    assert errors == []
    # Updates 0, 0 and 1000 per weight (15 weights): the last is clipped to norm 1, then the mean.
    expected = 1.0 + (1.0 / 15**0.5) / 3
    assert torch.allclose(persistor.load_model().params["fc.weight"], torch.full((3, 4), expected), atol=1e-6)
    queue.end_run()


def _error_result(current_round: int):
    shareable = DXO(DataKind.WEIGHTS, {}, {}).to_shareable()
    shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, current_round)
    shareable.set_return_code(ReturnCode.EXECUTION_EXCEPTION)
    return shareable


@pytest.mark.parametrize("ignore", [False, True], ids=["error-ends-the-job", "error-ignored"])
def test_a_clients_error_ends_the_job_unless_ignored(tmp_path: Path, ignore: bool) -> None:
    queue = TaskQueue(CLIENTS)
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(tmp_path)
    components = {
        "persistor": persistor,
        "aggregator": DXOAggregator(expected_data_kind="WEIGHTS"),
        "shareable_generator": FullModelShareableGenerator(),
    }
    workflow = ScatterAndGather(
        min_clients=2, num_rounds=1, wait_time_after_min_received=30, ignore_result_error=ignore
    )
    workflow.bind(queue, context=JobContext(workspace=tmp_path, components=components))
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(workflow.run, errors), daemon=True)
    thread.start()

    tasks = {client: _next_task(queue, client) for client in CLIENTS}
    queue.submit("site-1", tasks["site-1"].task_id, _error_result(0))
    for client in ("site-2", "site-3"):
        queue.submit(client, tasks[client].task_id, _result(DataKind.WEIGHTS, 3.0, 0))
    thread.join(10)
    queue.end_run()

    if ignore:  # two usable results of the three: the round counts them
        assert errors == []
        assert torch.equal(persistor.load_model().params["fc.weight"], torch.full((3, 4), 3.0))
    else:  # the task was cancelled at the error: the job ends with it
        assert len(errors) == 1 and isinstance(errors[0], WorkflowError)
        assert "a client's result is an error" in str(errors[0]) and "EXECUTION_EXCEPTION" in str(errors[0])


def test_more_min_clients_than_the_job_has_ends_it_with_a_workflow_error(tmp_path: Path) -> None:
    workflow = ScatterAndGather(min_clients=4, num_rounds=1)
    workflow.bind(TaskQueue(CLIENTS), context=JobContext(workspace=tmp_path, components={}))

    with pytest.raises(WorkflowError, match=r"^min_clients=4 but only 3 clients run the job$"):
        workflow.round_clients(random.Random(0))
