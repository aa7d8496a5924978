"""Scaffold against a real task queue, the test playing three clients for two rounds: the control
variate each task carries, the final one and the global model are the paper's, computed here
with numpy; a result whose delta is missing, unlike ``c`` or not finite is refused and counts
for nothing."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.client import scaffold as client_scaffold
from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.model import FLModel, ParamsType, ReturnCode, scaffold_keys
from engine.model.convert import model_from_shareable, shareable_from_model
from engine.persistors import ModelPersistor, PTFileModelPersistor
from engine.workflows import FedAvg, Scaffold
from engine.workflows import scaffold as server_scaffold

CLIENTS = ["site-1", "site-2", "site-3"]
STEPS = {"site-1": 1, "site-2": 3, "site-3": 4}  # FedAvg's weights (the control variate's mean is unweighted)
ROUNDS = 2
TRAINABLE = ["fc.weight", "fc.bias", "bn.weight", "bn.bias"]


class Net(torch.nn.Module):
    """Trainable parameters, a frozen one, and BatchNorm's float and integer buffers (no control variates)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.linspace(-1, 1, 12).reshape(3, 4))
            self.fc.bias.fill_(0.5)


def _next_task(queue: TaskQueue, client: str):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assignment = queue.next_task(client)
        if assignment is not None:
            return assignment
        time.sleep(0.01)
    raise AssertionError(f"{client} got no task")


def _update(client: str, current_round: int) -> dict[str, np.ndarray]:
    """How a client moves each float tensor this round (the integer counter stays)."""
    rng = np.random.default_rng(100 * current_round + int(client[-1]))
    shapes = {name: tuple(t.shape) for name, t in Net().state_dict().items() if t.is_floating_point()}
    return {name: rng.normal(0, 0.5, shape).astype(np.float32) for name, shape in shapes.items()}


def _delta(client: str, current_round: int) -> dict[str, np.ndarray]:
    """The client's control variate change this round."""
    rng = np.random.default_rng(1000 + 100 * current_round + int(client[-1]))
    shapes = dict(Net().named_parameters())
    return {name: rng.normal(0, 1.0, tuple(shapes[name].shape)).astype(np.float32) for name in TRAINABLE}


def _as_tensors(values: dict[str, np.ndarray]) -> dict[str, Any]:
    return {name: torch.from_numpy(value.copy()) for name, value in values.items()}


class Run:
    """One workflow run against the test's clients; ``bad`` replaces one client's delta meta in round 1."""

    def __init__(self, tmp_path: Path, workflow: FedAvg, bad: tuple[str, Any] | None = None) -> None:
        self.tmp_path, self.workflow, self.bad = tmp_path, workflow, bad
        self.sent_c: dict[int, dict[str, dict[str, np.ndarray]]] = {}  # round -> client -> c received
        self.events: list[tuple[str, dict]] = []

    def go(self) -> dict[str, np.ndarray]:
        queue = TaskQueue(CLIENTS)
        self.persistor = PTFileModelPersistor(model=Net())
        self.persistor.use_workspace(self.tmp_path)
        context = JobContext(
            workspace=self.tmp_path,
            components={"persistor": self.persistor},
            report=lambda event, **fields: self.events.append((event, fields)),
        )
        self.workflow.bind(queue, context=context)
        errors: list[BaseException] = []
        thread = threading.Thread(target=lambda: _capture(self.workflow.run, errors), daemon=True)
        thread.start()
        try:
            for current_round in range(ROUNDS):
                self.sent_c[current_round] = {}
                for client in reversed(CLIENTS):  # site-3 (whose result may be refused) first
                    task = _next_task(queue, client)
                    received = model_from_shareable(task.data)
                    c = received.meta[client_scaffold.C_GLOBAL_KEY]
                    self.sent_c[current_round][client] = {name: t.numpy().copy() for name, t in c.items()}
                    queue.submit(client, task.task_id, self._reply(client, current_round, received.params))
            thread.join(10)
        finally:
            queue.end_run()
        assert errors == []
        return {name: t.numpy() for name, t in self.persistor.load_model().params.items()}

    def _reply(self, client: str, current_round: int, received: dict[str, torch.Tensor]):
        update = _update(client, current_round)
        params = {
            name: value + torch.from_numpy(update[name]) if name in update else value.clone()
            for name, value in received.items()
        }
        meta: dict[str, Any] = {"NUM_STEPS_CURRENT_ROUND": STEPS[client]}
        if self.bad is not None and self.bad[0] == client and current_round == 0:
            if self.bad[1] is not _MISSING:
                meta[client_scaffold.C_DELTA_KEY] = self.bad[1]
        else:
            meta[client_scaffold.C_DELTA_KEY] = _as_tensors(_delta(client, current_round))
        result = shareable_from_model(FLModel(params=params, params_type=ParamsType.FULL, meta=meta))
        result.set_return_code(ReturnCode.OK)
        return result

    def refused(self, current_round: int) -> dict[str, str]:
        done = [fields for event, fields in self.events if event == "round_done" and fields["round"] == current_round]
        return done[0]["refused"]


_MISSING = object()


def _capture(function, errors: list[BaseException]) -> None:
    try:
        function()
    except BaseException as e:  # noqa: BLE001 - handed to the test
        errors.append(e)


def _expected(accepted: dict[int, list[str]]) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """The paper's x and c in float64 numpy: x the weighted mean, c += |S|/N * mean of the deltas.

    Returns the final model and the control variate at the start of each round and at the end.
    """
    x = {name: t.detach().numpy().astype(np.float64) for name, t in Net().state_dict().items()}
    c = {name: np.zeros(x[name].shape) for name in TRAINABLE}
    history = [dict(c)]
    n = len(CLIENTS)
    for current_round in range(ROUNDS):
        clients = accepted[current_round]
        total = sum(STEPS[client] for client in clients)
        for name in _update(clients[0], current_round):  # the float tensors (the counter stays)
            x[name] = sum(STEPS[k] * (x[name] + _update(k, current_round)[name]) for k in clients) / total
        mean_delta = {name: np.mean([_delta(k, current_round)[name] for k in clients], axis=0) for name in c}
        c = {name: c[name] + len(clients) / n * mean_delta[name] for name in c}
        history.append(dict(c))
    return x, history


def test_two_rounds_give_the_papers_control_variate_and_fedavgs_model(tmp_path: Path) -> None:
    run = Run(tmp_path, Scaffold(num_clients=3, num_rounds=ROUNDS))

    final = run.go()

    x, history = _expected({0: CLIENTS, 1: CLIENTS})
    for current_round in range(ROUNDS):
        for client in CLIENTS:
            sent = run.sent_c[current_round][client]
            assert sorted(sent) == sorted(TRAINABLE)  # no frozen parameter, no buffer
            for name in TRAINABLE:
                np.testing.assert_allclose(sent[name], history[current_round][name], rtol=1e-6, atol=1e-6)
    for name in TRAINABLE:
        np.testing.assert_allclose(run.workflow._c[name].numpy(), history[ROUNDS][name], rtol=1e-6, atol=1e-6)
    for name, value in x.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(history[1]["fc.weight"]).max() > 0.1  # c really moved
    assert final["bn.num_batches_tracked"] == 0


def test_the_client_and_server_take_the_meta_keys_from_one_module() -> None:
    engine_dir = Path(scaffold_keys.__file__).parents[1]

    for key in (scaffold_keys.C_GLOBAL_KEY, scaffold_keys.C_DELTA_KEY):
        assignment = re.compile(rf"^\s*\w+\s*(?::[^=]*)?=\s*[\"']{key}[\"']", re.MULTILINE)
        defined_in = [p for p in sorted(engine_dir.rglob("*.py")) if assignment.search(p.read_text(encoding="utf-8"))]
        assert defined_in == [Path(scaffold_keys.__file__)], key

    assert (server_scaffold.C_GLOBAL_KEY, server_scaffold.C_DELTA_KEY) == (
        client_scaffold.C_GLOBAL_KEY,
        client_scaffold.C_DELTA_KEY,
    )


def _delta_with(**changes: Any) -> dict[str, Any]:
    delta: dict[str, Any] = _as_tensors(_delta("site-3", 0))
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            del delta[name]
        else:
            delta[name] = value
    return delta


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (_MISSING, r"has no scaffold_c_delta meta: the training script must call ScaffoldClient.end_round\(\)"),
        ({"fc.weight": [1.0]}, r"scaffold_c_delta\['fc.weight'\] is not a tensor"),
        ("zeros", r"scaffold_c_delta must be a dict of tensors, got str"),
        (_delta_with(bn__bias=None), r"scaffold_c_delta: result of site-3 does not match the model: missing 'bn.bias'"),
        (
            _delta_with(bn__running_mean=torch.zeros(3)),
            r"scaffold_c_delta: result of site-3 does not match the model: unexpected 'bn.running_mean'",
        ),
        (_delta_with(fc__bias=torch.zeros(4)), r"'fc.bias': shape \(4,\), expected \(3,\)"),
        (_delta_with(fc__bias=torch.zeros(3, dtype=torch.float64)), r"'fc.bias': dtype float64, expected float32"),
        (
            _delta_with(fc__weight=torch.full((3, 4), float("nan"))),
            r"scaffold_c_delta: result of site-3 holds NaN or infinite values in 'fc.weight'",
        ),
        (_delta_with(bn__weight=torch.tensor([0.0, float("inf"), 0.0])), r"NaN or infinite values in 'bn.weight'"),
    ],
    ids=["missing", "not-a-tensor", "not-a-dict", "name-missing", "name-unexpected", "shape", "dtype", "nan", "inf"],
)
def test_a_bad_delta_is_refused_and_counts_for_nothing(tmp_path: Path, bad: Any, message: str) -> None:
    run = Run(
        tmp_path,
        Scaffold(num_clients=3, num_rounds=ROUNDS, min_clients=2, wait_time_after_min_received=10),
        bad=("site-3", bad),
    )

    final = run.go()

    assert re.search(message, run.refused(0)["site-3"]), run.refused(0)
    assert run.refused(1) == {}
    # Neither site-3's model nor its delta counted in round 1; c still grew by |S| / N = 2/3 of the mean.
    x, history = _expected({0: ["site-1", "site-2"], 1: CLIENTS})
    for name in TRAINABLE:
        np.testing.assert_allclose(run.sent_c[1]["site-1"][name], history[1][name], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(run.workflow._c[name].numpy(), history[2][name], rtol=1e-6, atol=1e-6)
    for name, value in x.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_result_the_aggregator_refuses_adds_no_delta(tmp_path: Path) -> None:
    """A weight above max_local_steps is refused by FedAvg's aggregator, after check_result passed."""
    run = Run(
        tmp_path,
        Scaffold(num_clients=3, num_rounds=ROUNDS, min_clients=2, wait_time_after_min_received=10, max_local_steps=3.5),
    )

    final = run.go()

    assert "NUM_STEPS_CURRENT_ROUND" in run.refused(0)["site-3"]
    x, history = _expected({0: ["site-1", "site-2"], 1: ["site-1", "site-2"]})
    for name in TRAINABLE:
        np.testing.assert_allclose(run.workflow._c[name].numpy(), history[2][name], rtol=1e-6, atol=1e-6)
    for name, value in x.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


class _StateDictPersistor(ModelPersistor):
    """A persistor without a module: Scaffold cannot tell trainable tensors from buffers."""

    def load_model(self) -> FLModel:
        return FLModel(params=dict(Net().state_dict()))

    def save_model(self, model: FLModel) -> Path:
        return self.models_dir / "unsaved"


@pytest.mark.parametrize(
    ("persistor", "names"),
    [
        (PTFileModelPersistor(model=Net()), TRAINABLE),
        (
            _StateDictPersistor(),
            [*TRAINABLE, "bn.running_mean", "bn.running_var", "frozen"],  # every float tensor, no counter
        ),
    ],
    ids=["module", "no-module"],
)
def test_the_control_variate_covers_the_trainable_tensors_the_persistor_knows(
    tmp_path: Path, persistor: ModelPersistor, names: list[str]
) -> None:
    workflow = Scaffold()
    workflow.bind(TaskQueue(CLIENTS), context=JobContext(workspace=tmp_path, components={"persistor": persistor}))
    workflow.make_aggregator()
    model = persistor.load_model()
    shapes = {name: tuple(t.shape) for name, t in model.params.items()}

    c = model_from_shareable(workflow.task_data(model, 0)).meta[client_scaffold.C_GLOBAL_KEY]

    assert sorted(c) == sorted(names)
    assert all(tuple(t.shape) == shapes[name] and not t.any() and t.dtype == torch.float32 for name, t in c.items())
