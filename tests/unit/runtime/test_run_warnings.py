"""Warnings of a run: a job that does not fit ``-n``, a key metric never reported, a client's last error lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import load_job
from engine.model import FLModel, ParamsType
from engine.persistors.pt_file import PTFileModelPersistor
from engine.runtime.job_end import end_of_run_warnings
from engine.runtime.progress import summary_table
from engine.runtime.run_setup import error_tail
from engine.runtime.run_warnings import run_warnings

JOBS = Path(__file__).resolve().parents[3] / "jobs"
SERVER = "jobs/fedavg/app/config/config_fed_server.conf"


@pytest.fixture
def fedavg(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(JOBS.parent)
    return load_job("jobs/fedavg")


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        pytest.param(2, [], id="fits"),
        pytest.param(
            4,
            [
                f"{SERVER}:14: workflows[0].args.num_clients: 2 clients sampled per round, but the run has 4: "
                "each round trains only 2 (set num_clients = 4 to train them all)",
            ],
            id="more-clients-than-sampled",
        ),
    ],
)
def test_run_warnings_of_the_fedavg_example(fedavg, n: int, expected: list[str]) -> None:
    clients = [f"site-{i}" for i in range(1, n + 1)]

    assert run_warnings(fedavg, clients) == expected


def test_fewer_clients_than_sampled_is_no_warning(fedavg) -> None:
    fedavg.meta.data["min_clients"] = 1

    assert run_warnings(fedavg, ["site-1"]) == []  # the example's shards follow the sites, whatever their number


def test_a_workflow_that_samples_a_fraction_is_not_said_to_sample_num_clients(fedavg) -> None:
    fedavg.apps["app"].server.data["workflows"][0]["args"]["sample_fraction"] = 0.5

    warnings = run_warnings(fedavg, [f"site-{i}" for i in range(1, 5)])

    assert not any("num_clients" in warning for warning in warnings)


def test_a_num_clients_left_out_is_the_workflows_default(fedavg) -> None:
    del fedavg.apps["app"].server.data["workflows"][0]["args"]["num_clients"]  # FedAvg's default is 2

    warnings = run_warnings(fedavg, ["site-1", "site-2", "site-3"])

    assert any("2 clients sampled per round, but the run has 3" in w for w in warnings), warnings


def test_a_default_num_clients_reached_through_kwargs_is_the_parents(fedavg) -> None:
    workflow = fedavg.apps["app"].server.data["workflows"][0]
    workflow["path"] = "engine.workflows.FedOpt"  # its **fedavg_args take FedAvg's num_clients (default 2)
    del workflow["args"]["num_clients"]

    warnings = run_warnings(fedavg, ["site-1", "site-2", "site-3"])

    assert any("2 clients sampled per round, but the run has 3" in w for w in warnings), warnings


def saved(persistor: PTFileModelPersistor, metrics: dict[str, float]) -> None:
    persistor.save_model(FLModel(params={"weight": torch.zeros(2)}, params_type=ParamsType.FULL, metrics=metrics))
    persistor.flush()


@pytest.mark.parametrize(
    ("key_metric", "rounds", "expected"),
    [
        pytest.param("global_accuracy", [{"global_accuracy": 0.5, "local_accuracy": 0.4}], [], id="reported"),
        pytest.param(
            "acuracy",
            [{"global_accuracy": 0.5}, {"local_accuracy": 0.4}],
            [
                "key_metric 'acuracy' was never reported; reported metrics: global_accuracy, local_accuracy "
                "(no best_global.safetensors was written: set key_metric to one of them)"
            ],
            id="mistyped",
        ),
        pytest.param("accuracy", [], [], id="nothing-saved"),
    ],
)
def test_the_persistor_says_when_its_key_metric_never_came(
    tmp_path: Path, key_metric: str, rounds: list[dict[str, float]], expected: list[str]
) -> None:
    persistor = PTFileModelPersistor(torch.nn.Linear(2, 1), key_metric=key_metric)
    persistor.use_workspace(tmp_path)
    for metrics in rounds:
        saved(persistor, metrics)

    assert persistor.end_of_run_warnings() == expected
    assert (tmp_path / "models" / "best_global.safetensors").exists() is (not expected and bool(rounds))


class _Warns:
    def end_of_run_warnings(self) -> list[str]:
        return ["something is off"]


class _Raises:
    def end_of_run_warnings(self) -> list[str]:
        raise RuntimeError("broken hook")


def test_the_server_collects_each_components_warnings_by_id() -> None:
    components = {"persistor": _Warns(), "broken": _Raises(), "plain": object()}

    assert end_of_run_warnings(components) == ["persistor: something is off"]


def test_the_summary_prints_the_warnings_escaped() -> None:
    summary = {"status": "FINISHED_COMPLETED", "warnings": ["key_metric 'acc\x1b[31m' was never reported"]}

    lines = summary_table(summary)

    assert "warning: key_metric 'acc\\x1b[31m' was never reported" in lines


def test_error_tail_keeps_the_last_lines_escaped(tmp_path: Path) -> None:
    errors = tmp_path / "stderr.txt"
    errors.write_text("Traceback:\n\n" + "".join(f"line {i}\n" for i in range(10)) + "Boom: \x1b]0;pwned\x07\n")

    assert error_tail(errors) == ["line 6", "line 7", "line 8", "line 9", "Boom: \\x1b]0;pwned\\x07"]
    assert error_tail(tmp_path / "missing.txt") == []
