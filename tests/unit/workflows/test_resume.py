"""A workflow stopped after some rounds and resumed from its checkpoint by a fresh workflow and
persistor (a new server process) ends at the model of a run that never stopped: FedAvg with
seeded sampling, FedOpt (Adam's moments), SCAFFOLD (the control variate), ScatterAndGather."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from engine.aggregators import DXOAggregator
from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.errors import CheckpointError
from engine.model import FLModel, ParamsType, ReservedHeaderKey, ReturnCode
from engine.model.convert import model_from_shareable, shareable_from_model
from engine.model.scaffold_keys import C_DELTA_KEY, C_GLOBAL_KEY
from engine.persistors import PTFileModelPersistor
from engine.workflows import FedAvg, FedOpt, FullModelShareableGenerator, Scaffold, ScatterAndGather

CLIENTS = ["site-1", "site-2", "site-3", "site-4"]
ROUNDS = 6


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 2)


def _answer(site: str, data, scaffold: bool) -> object:
    model = model_from_shareable(data)
    k = CLIENTS.index(site) + 1
    rnd = data.get_header(ReservedHeaderKey.CURRENT_ROUND)
    params = {name: t + 0.01 * k * (rnd + 1) + 0.1 * torch.sin(t) for name, t in model.params.items()}
    meta = {"NUM_STEPS_CURRENT_ROUND": k}
    if scaffold:  # the step correction: the result depends on the server's control variate
        c_global = model.meta[C_GLOBAL_KEY]
        params = {name: t - c_global[name] for name, t in params.items()}
        meta[C_DELTA_KEY] = {name: torch.full_like(t, 0.001 * k) + 0.01 * t for name, t in model.params.items()}
    result = shareable_from_model(FLModel(params=params, params_type=ParamsType.FULL, meta=meta))
    result.set_return_code(ReturnCode.OK)
    return result


def _play(workflow, workspace: Path, resuming: bool, stop_after: int | None, scaffold: bool = False) -> list[dict]:
    """Run ``workflow`` against a real queue with the test as the clients; stop it at round ``stop_after``'s start."""
    queue = TaskQueue(CLIENTS)
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(workspace)
    events: list[tuple[str, dict]] = []
    components = {
        "persistor": persistor,
        "aggregator": DXOAggregator(expected_data_kind="WEIGHTS"),
        "shareable_generator": FullModelShareableGenerator(),
    }
    context = JobContext(
        workspace=workspace,
        components=components,
        report=lambda event, **fields: events.append((event, fields)),
        checkpoint_dir=workspace / "checkpoint" / "wf",
        resuming=resuming,
    )
    workflow.bind(queue, context=context)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            workflow.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while thread.is_alive() and time.monotonic() < deadline:
        started = [f for e, f in events if e == "round_started"]
        if stop_after is not None and started and started[-1]["round"] == stop_after:
            workflow.abort_signal.set()  # the server stops as round `stop_after` begins
            queue.cancel_all()
        for site in CLIENTS:
            assignment = queue.next_task(site)
            if assignment is not None:
                queue.submit(site, assignment.task_id, _answer(site, assignment.data, scaffold))
        time.sleep(0.002)
    thread.join(10)
    queue.end_run()
    if errors:
        raise errors[0]
    return [f for e, f in events if e == "round_done"]


def _final(workspace: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(workspace / "models" / "global.safetensors"))


def _workflows():
    return {
        "fedavg-sampled": (lambda: FedAvg(num_clients=2, num_rounds=ROUNDS, sample_seed=11), False),
        "fedopt-adam": (lambda: FedOpt(num_clients=3, num_rounds=ROUNDS, sample_seed=3, server_lr=0.05), False),
        "scaffold": (lambda: Scaffold(num_clients=4, num_rounds=ROUNDS), True),
        "scatter-and-gather": (
            lambda: ScatterAndGather(min_clients=4, num_rounds=ROUNDS, wait_time_after_min_received=0),
            False,
        ),
    }


@pytest.mark.parametrize("name", list(_workflows()))
def test_a_resumed_workflow_ends_at_the_uninterrupted_runs_model(tmp_path: Path, name: str) -> None:
    make, scaffold = _workflows()[name]
    whole = _play(make(), tmp_path / "whole", resuming=False, stop_after=None, scaffold=scaffold)

    first = _play(make(), tmp_path / "stopped", resuming=False, stop_after=3, scaffold=scaffold)
    second = _play(make(), tmp_path / "stopped", resuming=True, stop_after=None, scaffold=scaffold)

    assert [r["round"] for r in first] == [0, 1, 2]
    assert [r["round"] for r in second] == [3, 4, 5]  # it went on where it stopped
    assert [r["sampled"] for r in first + second] == [r["sampled"] for r in whole]  # the same draws
    expected, got = _final(tmp_path / "whole"), _final(tmp_path / "stopped")
    for key in expected:
        assert torch.allclose(got[key], expected[key], rtol=0, atol=1e-6), key


def test_a_corrupt_checkpoint_ends_the_resume_naming_the_file(tmp_path: Path) -> None:
    _play(FedAvg(num_clients=2, num_rounds=ROUNDS), tmp_path, resuming=False, stop_after=2)
    model = next((tmp_path / "checkpoint" / "wf").glob("model-*.safetensors"))
    model.write_bytes(model.read_bytes()[:100])

    with pytest.raises(CheckpointError, match=rf"{model.name}: 100 bytes, the checkpoint recorded \d+"):
        _play(FedAvg(num_clients=2, num_rounds=ROUNDS), tmp_path, resuming=True, stop_after=None)
