"""FedOpt against a real task queue, the test playing two clients for three rounds: each server
optimizer's global model is the one the paper's formulas give, computed here with numpy."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.model import FLModel, ParamsType, ReturnCode
from engine.model.convert import model_from_shareable, shareable_from_model
from engine.persistors import PTFileModelPersistor
from engine.workflows import FedAvg, FedOpt

CLIENTS = ["site-1", "site-2"]
STEPS = {"site-1": 1, "site-2": 3}  # the clients' weights
ROUNDS = 3


class Net(torch.nn.Module):
    """A layer and an integer counter (as BatchNorm's ``num_batches_tracked``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("counter", torch.tensor(5, dtype=torch.int64))
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


def _reply(params: dict, client: str, params_type: ParamsType):
    model = FLModel(params=params, params_type=params_type, meta={"NUM_STEPS_CURRENT_ROUND": STEPS[client]})
    result = shareable_from_model(model)
    result.set_return_code(ReturnCode.OK)
    return result


def _client_update(client: str, current_round: int) -> dict[str, np.ndarray]:
    """What a client changes this round: a different random move per client and round."""
    rng = np.random.default_rng(100 * current_round + int(client[-1]))
    return {
        "fc.weight": rng.normal(0, 0.5, (3, 4)).astype(np.float32),
        "fc.bias": rng.normal(0, 0.5, 3).astype(np.float32),
        "counter": np.array(2 * int(client[-1]), dtype=np.int64),  # the counter moves by 2 or 4
    }


def _run_workflow(tmp_path: Path, workflow: FedAvg, params_type: ParamsType) -> dict[str, np.ndarray]:
    """Run ``workflow`` against the two test clients; return the final global model as numpy."""
    queue = TaskQueue(CLIENTS)
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(tmp_path)
    workflow.bind(queue, context=JobContext(workspace=tmp_path, components={"persistor": persistor}))
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(workflow.run, errors), daemon=True)
    thread.start()
    try:
        for current_round in range(ROUNDS):
            for client in CLIENTS:
                task = _next_task(queue, client)
                received = model_from_shareable(task.data).params
                update = _client_update(client, current_round)
                if params_type is ParamsType.FULL:
                    params = {name: received[name] + torch.from_numpy(update[name]) for name in received}
                else:
                    params = {name: torch.from_numpy(value) for name, value in update.items()}
                queue.submit(client, task.task_id, _reply(params, client, params_type))
        thread.join(10)
    finally:
        queue.end_run()
    assert errors == []
    return {name: tensor.numpy() for name, tensor in persistor.load_model().params.items()}


def _capture(function, errors: list[BaseException]) -> None:
    try:
        function()
    except BaseException as e:  # noqa: BLE001 - handed to the test
        errors.append(e)


def _expected(
    optimizer: str, lr: float, momentum=0.9, b1=0.9, b2=0.99, eps=1e-3, diff: bool = False
) -> dict[str, np.ndarray]:
    """The paper's formulas in float64 numpy, from the same initial model and client updates."""
    net = Net()
    x = {name: t.detach().numpy().astype(np.float64) for name, t in net.state_dict().items()}
    m = {name: np.zeros_like(v) for name, v in x.items()}
    v = {name: np.zeros_like(value) for name, value in x.items()}
    total = sum(STEPS.values())
    for current_round in range(ROUNDS):
        updates = {client: _client_update(client, current_round) for client in CLIENTS}
        for name in x:
            d = sum(STEPS[c] * updates[c][name].astype(np.float64) for c in CLIENTS) / total
            if name == "counter":  # integers: the plain mean (of models, or of differences), rounded
                x[name] = x[name] + np.round(d) if diff else np.round(x[name] + d)
                continue
            if optimizer == "sgd":
                step = d
            elif optimizer == "momentum":
                m[name] = momentum * m[name] + d
                step = m[name]
            else:
                m[name] = b1 * m[name] + (1 - b1) * d
                if optimizer == "adam":
                    v[name] = b2 * v[name] + (1 - b2) * d**2
                elif optimizer == "yogi":
                    v[name] = v[name] - (1 - b2) * d**2 * np.sign(v[name] - d**2)
                else:
                    v[name] = v[name] + d**2
                step = m[name] / (np.sqrt(v[name]) + eps)
            x[name] = x[name] + lr * step
    return x


@pytest.mark.parametrize(
    ("optimizer", "lr"),
    [("sgd", 0.7), ("momentum", 0.5), ("adam", 0.05), ("yogi", 0.05), ("adagrad", 0.05)],
    ids=["sgd", "momentum", "adam", "yogi", "adagrad"],
)
def test_three_rounds_of_each_optimizer_give_the_papers_model(tmp_path: Path, optimizer: str, lr: float) -> None:
    workflow = FedOpt(num_rounds=ROUNDS, server_optimizer=optimizer, server_lr=lr)

    final = _run_workflow(tmp_path, workflow, ParamsType.FULL)

    expected = _expected(optimizer, lr)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    assert final["counter"].dtype == np.int64  # 5 + 3.5 a round, rounded half to even: 8, 12, 16
    assert not list(tmp_path.glob("fedopt_state-*"))  # in memory without download_to_disk


def test_diff_results_are_the_pseudo_gradient_itself(tmp_path: Path) -> None:
    workflow = FedOpt(num_rounds=ROUNDS, server_optimizer="adam", server_lr=0.05, expected_params_type="DIFF")

    final = _run_workflow(tmp_path, workflow, ParamsType.DIFF)

    for name, value in _expected("adam", 0.05, diff=True).items():
        np.testing.assert_allclose(final[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_sgd_with_a_step_of_one_is_fedavg(tmp_path: Path) -> None:
    fedopt = _run_workflow(tmp_path / "fedopt", FedOpt(num_rounds=ROUNDS, server_optimizer="sgd"), ParamsType.FULL)
    fedavg = _run_workflow(tmp_path / "fedavg", FedAvg(num_rounds=ROUNDS), ParamsType.FULL)

    for name, value in fedavg.items():
        np.testing.assert_allclose(fedopt[name], value, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"server_optimizer": "lamb"},
            r"server_optimizer: expected one of sgd, momentum, adam, yogi, adagrad, got 'lamb'",
        ),
        ({"server_lr": 0}, r"server_lr: expected a finite number > 0, got 0"),
        ({"server_lr": float("nan")}, r"server_lr: expected a finite number > 0"),
        ({"server_lr": True}, r"server_lr: expected a finite number > 0, got True"),
        ({"momentum": 1.0}, r"momentum: expected a number in \[0, 1\), got 1.0"),
        ({"beta1": -0.1}, r"beta1: expected a number in \[0, 1\), got -0.1"),
        ({"beta2": "0.9"}, r"beta2: expected a number in \[0, 1\), got '0.9'"),
        ({"epsilon": 0.0}, r"epsilon: expected a finite number > 0, got 0.0"),
        ({"num_rounds": 0}, r"num_rounds: expected an integer >= 1, got 0"),
    ],
    ids=["optimizer", "lr-zero", "lr-nan", "lr-bool", "momentum", "beta1", "beta2", "epsilon", "fedavg-arg"],
)
def test_bad_args_are_refused_naming_the_arg(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedOpt(**args)


def test_the_default_server_lr_suits_the_optimizer() -> None:
    assert FedOpt(server_optimizer="sgd").optimizer.lr == 1.0
    assert FedOpt(server_optimizer="momentum").optimizer.lr == 1.0
    assert FedOpt().optimizer.name == "adam" and FedOpt().optimizer.lr == 0.01
