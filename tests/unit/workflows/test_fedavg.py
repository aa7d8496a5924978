"""FedAvg against a real task queue, with the test playing the clients: the weighted mean, DIFF
results applied to the saved global model, and the global weights let go while clients train."""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from engine.aggregators import NormClippingAggregator
from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.model import FLModel, ParamsType, ReturnCode
from engine.model.convert import model_from_shareable, shareable_from_model
from engine.persistors import PTFileModelPersistor
from engine.workflows import FedAvg

CLIENTS = ["site-1", "site-2"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.fc.weight.fill_(1.0)
            self.fc.bias.fill_(2.0)


@pytest.fixture
def run(tmp_path: Path):
    """Start FedAvg in a thread against a real queue; yield (queue, persistor, the thread)."""
    started = []

    def start(components: dict | None = None, **args) -> tuple[TaskQueue, PTFileModelPersistor, threading.Thread]:
        queue = TaskQueue(CLIENTS)
        persistor = PTFileModelPersistor(model=Net())
        persistor.use_workspace(tmp_path)
        workflow = FedAvg(num_clients=2, persistor_id="persistor", **args)
        events: list[tuple[str, dict]] = []
        context = JobContext(
            workspace=tmp_path,
            components={"persistor": persistor, **(components or {})},
            report=lambda event, **fields: events.append((event, fields)),
        )
        workflow.bind(queue, context=context)
        errors: list[BaseException] = []
        thread = threading.Thread(target=lambda: _capture(workflow.run, errors), daemon=True)
        thread.errors = errors  # type: ignore[attr-defined]
        thread.workflow = workflow  # type: ignore[attr-defined]
        thread.events = events  # type: ignore[attr-defined]
        thread.start()
        started.append(queue)
        return queue, persistor, thread

    yield start
    for queue in started:
        queue.end_run()


def _capture(function, errors: list[BaseException]) -> None:
    try:
        function()
    except BaseException as e:  # noqa: BLE001 - handed to the test
        errors.append(e)


def next_task(queue: TaskQueue, client: str):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assignment = queue.next_task(client)
        if assignment is not None:
            return assignment
        time.sleep(0.01)
    raise AssertionError(f"{client} got no task")


def reply(params: dict, steps: int, params_type: ParamsType = ParamsType.FULL, metrics: dict | None = None):
    result = shareable_from_model(
        FLModel(params=params, params_type=params_type, metrics=metrics, meta={"NUM_STEPS_CURRENT_ROUND": steps})
    )
    result.set_return_code(ReturnCode.OK)
    return result


def test_full_results_average_and_the_global_weights_are_let_go_while_clients_train(run) -> None:
    queue, persistor, thread = run(num_rounds=1)

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    watched = weakref.ref(model_from_shareable(first.data).params["fc.weight"])
    first_id, second_id = first.task_id, second.task_id
    del first, second  # the runtime has encoded the task for both and let go of it
    deadline = time.monotonic() + 5  # the checkpoint is written meanwhile, then let go too
    while watched() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert watched() is None  # nobody on the server holds the round's global weights now

    queue.submit("site-1", first_id, reply({"fc.weight": torch.full((3, 4), 2.0), "fc.bias": torch.zeros(3)}, 1))
    queue.submit("site-2", second_id, reply({"fc.weight": torch.full((3, 4), 5.0), "fc.bias": torch.ones(3)}, 2))
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    final = persistor.load_model().params
    assert torch.allclose(final["fc.weight"], torch.full((3, 4), 4.0))
    assert torch.allclose(final["fc.bias"], torch.full((3,), 2 / 3))


def test_diff_results_are_added_to_the_saved_global_model(run) -> None:
    queue, persistor, thread = run(num_rounds=2, expected_params_type="DIFF")

    for _ in range(2):
        first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
        diff = {"fc.weight": torch.full((3, 4), 0.5)}  # a DIFF may leave names out
        queue.submit("site-1", first.task_id, reply(diff, 1, ParamsType.DIFF))
        queue.submit("site-2", second.task_id, reply(diff, 1, ParamsType.DIFF))
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    final = persistor.load_model().params
    assert torch.allclose(final["fc.weight"], torch.full((3, 4), 2.0))  # 1 + 2 x 0.5
    assert torch.allclose(final["fc.bias"], torch.full((3,), 2.0))  # untouched


def test_a_result_that_does_not_fit_the_model_is_refused(run) -> None:
    queue, persistor, thread = run(num_rounds=1, min_clients=1)

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    queue.submit("site-1", first.task_id, reply({"fc.weight": torch.zeros(2, 2), "fc.bias": torch.zeros(3)}, 1))
    queue.submit("site-2", second.task_id, reply({"fc.weight": torch.zeros(3, 4), "fc.bias": torch.zeros(3)}, 1))
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    assert torch.equal(persistor.load_model().params["fc.weight"], torch.zeros(3, 4))
    assert "'fc.weight': shape (2, 2), expected (3, 4)" in thread.workflow.failures["site-1"]  # type: ignore[attr-defined]


def test_an_abort_in_the_next_round_keeps_the_last_rounds_model(run) -> None:
    queue, persistor, thread = run(num_rounds=3)

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    queue.submit("site-1", first.task_id, reply({"fc.weight": torch.full((3, 4), 2.0), "fc.bias": torch.zeros(3)}, 1))
    queue.submit("site-2", second.task_id, reply({"fc.weight": torch.full((3, 4), 5.0), "fc.bias": torch.ones(3)}, 2))
    next_task(queue, "site-1")  # the second round has begun
    thread.workflow.abort_signal.set()  # type: ignore[attr-defined]
    queue.cancel_all()
    thread.join(10)

    assert not thread.is_alive()
    assert thread.errors == []  # type: ignore[attr-defined]
    assert torch.allclose(persistor.load_model().params["fc.weight"], torch.full((3, 4), 4.0))


def test_a_result_claiming_too_many_local_steps_is_refused_and_the_round_goes_on(run) -> None:
    queue, persistor, thread = run(num_rounds=1, min_clients=1, max_local_steps=1000)

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    queue.submit(
        "site-1", first.task_id, reply({"fc.weight": torch.full((3, 4), 99.0), "fc.bias": torch.zeros(3)}, 10**6)
    )
    queue.submit(
        "site-2", second.task_id, reply({"fc.weight": torch.full((3, 4), 3.0), "fc.bias": torch.zeros(3)}, 1000)
    )
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    assert torch.equal(persistor.load_model().params["fc.weight"], torch.full((3, 4), 3.0))
    assert "above the aggregator's max_local_steps = 1000" in thread.workflow.failures["site-1"]  # type: ignore[attr-defined]


def _honest(value: float) -> dict:
    return {"fc.weight": torch.full((3, 4), value), "fc.bias": torch.zeros(3)}


def test_a_result_with_nan_is_refused_for_that_site_alone(run) -> None:
    queue, persistor, thread = run(num_rounds=1, min_clients=1)

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    poisoned = _honest(1.0)
    poisoned["fc.bias"][1] = float("nan")
    queue.submit("site-1", first.task_id, reply(poisoned, 1))
    queue.submit("site-2", second.task_id, reply(_honest(3.0), 1))
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    assert torch.equal(persistor.load_model().params["fc.weight"], torch.full((3, 4), 3.0))
    refused = thread.workflow.refused  # type: ignore[attr-defined]
    assert list(refused) == ["site-1"]
    assert "holds NaN or infinite values in 'fc.bias'" in refused["site-1"]
    done = [fields for event, fields in thread.events if event == "round_done"]  # type: ignore[attr-defined]
    assert done[0]["clients"] == ["site-2"] and list(done[0]["refused"]) == ["site-1"]


def test_allow_non_finite_lets_such_a_result_count(run) -> None:
    queue, persistor, thread = run(num_rounds=1, allow_non_finite=True)

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    queue.submit("site-1", first.task_id, reply({**_honest(1.0), "fc.bias": torch.full((3,), float("inf"))}, 1))
    queue.submit("site-2", second.task_id, reply(_honest(3.0), 1))
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    assert torch.isinf(persistor.load_model().params["fc.bias"]).all()


def test_a_diff_among_full_results_is_refused_whichever_arrives_first(run) -> None:
    queue, persistor, thread = run(num_rounds=1, min_clients=1)

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    queue.submit("site-1", first.task_id, reply(_honest(50.0), 1, ParamsType.DIFF))  # the liar is first
    queue.submit("site-2", second.task_id, reply(_honest(3.0), 1))
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    assert torch.equal(persistor.load_model().params["fc.weight"], torch.full((3, 4), 3.0))
    assert "has DIFF params, this workflow expects FULL" in thread.workflow.refused["site-1"]  # type: ignore[attr-defined]


def test_metrics_outside_the_declared_range_or_not_finite_do_not_count(run) -> None:
    queue, persistor, thread = run(num_rounds=1, metric_ranges={"accuracy": [0, 1]})

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    lies = {"accuracy": 1e9, "loss": float("nan"), "\x1b[2Jwiped": 0.5, "note": "text"}
    queue.submit("site-1", first.task_id, reply(_honest(1.0), 1, metrics=lies))
    queue.submit("site-2", second.task_id, reply(_honest(3.0), 1, metrics={"accuracy": 0.5, "loss": 0.25}))
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    assert torch.equal(persistor.load_model().params["fc.weight"], torch.full((3, 4), 2.0))  # params still count
    done = [fields for event, fields in thread.events if event == "round_done"]  # type: ignore[attr-defined]
    assert done[0]["metrics"] == {"accuracy": 0.5, "loss": 0.25}  # only site-2's were accepted


def test_clipping_reads_the_saved_global_model_and_bounds_a_scaled_update(run) -> None:
    # The global model is fc.weight = 1, fc.bias = 2 (Net); site-1 moves every weight by +0.1,
    # site-2 (the liar) by +100: its update is clipped to norm 1 before the weighted mean.
    clip = NormClippingAggregator(max_norm=1.0)
    queue, persistor, thread = run(num_rounds=1, aggregator_id="clip", components={"clip": clip})

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    queue.submit(
        "site-1", first.task_id, reply({"fc.weight": torch.full((3, 4), 1.1), "fc.bias": torch.full((3,), 2.1)}, 1)
    )
    queue.submit(
        "site-2", second.task_id, reply({"fc.weight": torch.full((3, 4), 101.0), "fc.bias": torch.full((3,), 102.0)}, 1)
    )
    thread.join(10)

    assert thread.errors == []  # type: ignore[attr-defined]
    honest = torch.full((15,), 0.1)  # site-1's update: norm 0.387 < 1, kept as it is
    liar = torch.full((15,), 100.0)
    liar = liar / liar.norm()  # clipped to norm 1
    mean = (honest + liar) / 2
    final = persistor.load_model().params
    assert torch.allclose(final["fc.weight"], 1.0 + mean[:12].reshape(3, 4), atol=1e-6)
    assert torch.allclose(final["fc.bias"], 2.0 + mean[12:], atol=1e-6)


def test_seeded_sampling_by_fraction_repeats_and_is_reported(tmp_path: Path) -> None:
    sites = [f"site-{i}" for i in range(1, 6)]

    def samples(seed: int) -> list[list[str]]:
        workflow = FedAvg(sample_fraction=0.4, sample_seed=seed)
        workflow.bind(TaskQueue(sites), context=JobContext(workspace=tmp_path, components={}))
        rng = random.Random(workflow.sample_seed)
        return [workflow.sample_clients(workflow._sample_count(), rng) for _ in range(6)]

    first, again, other = samples(7), samples(7), samples(8)

    assert first == again and first != other  # the same seed, the same clients each round
    assert all(len(chosen) == 2 and set(chosen) <= set(sites) for chosen in first)  # ceil(0.4 x 5)
    assert len({tuple(chosen) for chosen in first}) > 1  # not the same two every round


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"sample_fraction": 0}, r"sample_fraction: expected a number in \(0, 1\], got 0"),
        ({"sample_fraction": 1.5}, r"got 1.5"),
        ({"sample_seed": "x"}, r"sample_seed: expected an integer, got 'x'"),
    ],
)
def test_bad_sampling_args_are_refused(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedAvg(**args)


def test_the_round_reports_which_clients_were_sampled(run) -> None:
    queue, persistor, thread = run(num_rounds=1, sample_seed=3)

    first, second = next_task(queue, "site-1"), next_task(queue, "site-2")
    queue.submit("site-1", first.task_id, reply(_honest(1.0), 1))
    queue.submit("site-2", second.task_id, reply(_honest(3.0), 1))
    thread.join(10)

    done = [fields for event, fields in thread.events if event == "round_done"]  # type: ignore[attr-defined]
    assert done[0]["sampled"] == ["site-1", "site-2"]
