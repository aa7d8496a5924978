"""A round whose key metric one site alone decided never picks the best model (issue 37): FedAvg's
round loop against a real task queue, the real weighted aggregator and the real persistor, the
test playing the clients; and the rule itself (`metrics_from_one_site`) as a table."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from engine.aggregators.rules import marked_from_one_site, metrics_from_one_site
from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.model import FLModel, MetaKey, ParamsType, ReturnCode
from engine.model.convert import shareable_from_model
from engine.persistors import PTFileModelPersistor
from engine.workflows import FedAvg


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)


class Job:
    """A FedAvg job of ``clients`` run in a thread; the test answers each site's task."""

    def __init__(self, tmp_path: Path, clients: list[str], **fedavg_args: object) -> None:
        self.queue = TaskQueue(clients)
        self.persistor = PTFileModelPersistor(model=Net(), key_metric="accuracy")
        self.persistor.use_workspace(tmp_path)
        self.events: list[tuple[str, dict]] = []
        self.errors: list[BaseException] = []
        self.workflow = FedAvg(num_clients=len(clients), **fedavg_args)
        context = JobContext(
            workspace=tmp_path,
            components={"persistor": self.persistor},
            report=lambda event, **fields: self.events.append((event, fields)),
        )
        self.workflow.bind(self.queue, context=context)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.workflow.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.errors.append(e)

    def answer(self, client: str, weight: float, accuracy: float, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (assignment := self.queue.next_task(client)) is None:
            assert time.monotonic() < deadline, f"{client} got no task"
            time.sleep(0.01)
        result = shareable_from_model(
            FLModel(
                params={"fc.weight": torch.full((1, 2), weight), "fc.bias": torch.zeros(1)},
                params_type=ParamsType.FULL,
                metrics={"accuracy": accuracy},
                meta={"NUM_STEPS_CURRENT_ROUND": 1},
            )
        )
        result.set_return_code(ReturnCode.OK)
        self.queue.submit(client, assignment.task_id, result)

    def finish(self, timeout_s: float = 20.0) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive()
        self.queue.end_run()
        self.persistor.flush()

    def rounds(self) -> list[dict]:
        return [fields for event, fields in self.events if event == "round_done"]

    def best_weight(self) -> float | None:
        best = self.persistor.models_dir / "best_global.safetensors"
        return float(safetensors.torch.load_file(best)["fc.weight"][0, 0]) if best.exists() else None


def test_a_round_one_site_decided_is_not_best_and_a_round_two_sites_decided_is(tmp_path: Path) -> None:
    job = Job(tmp_path, ["site-1", "site-2"], num_rounds=2, min_clients=1, wait_time_after_min_received=10.0)

    job.answer("site-2", float("nan"), 0.5)  # round 1: site-2's result is refused (NaN weights)...
    job.answer("site-1", 1.0, 0.99)  # ...so site-1's 0.99 alone is the round's accuracy
    job.answer("site-1", 2.0, 0.6)  # round 2: both count, accuracy 0.7
    job.answer("site-2", 4.0, 0.8)
    job.finish()

    assert job.errors == []
    first, second = job.rounds()
    assert (first["clients"], first["metrics"]) == (["site-1"], {"accuracy": pytest.approx(0.99)})
    assert first["metrics_from_one_site"] == ["accuracy"]
    assert second["metrics"] == {"accuracy": pytest.approx(0.7)} and "metrics_from_one_site" not in second
    assert job.best_weight() == pytest.approx(3.0)  # round 2's model, though round 1's 0.99 is higher
    assert job.persistor.resume_state()["best"] == pytest.approx(0.7)


def test_a_site_whose_key_metric_was_dropped_leaves_the_round_to_one_site(tmp_path: Path) -> None:
    # Two results count, but site-2's accuracy is outside the default range [0, 1] and dropped.
    job = Job(tmp_path, ["site-1", "site-2"], num_rounds=1)

    job.answer("site-1", 1.0, 0.99)
    job.answer("site-2", 3.0, 5.0)
    job.finish()

    assert job.errors == []
    (done,) = job.rounds()
    assert done["clients"] == ["site-1", "site-2"] and done["metrics_from_one_site"] == ["accuracy"]
    assert job.best_weight() is None


def test_a_job_with_a_single_client_still_picks_its_best_model(tmp_path: Path) -> None:
    job = Job(tmp_path, ["site-1"], num_rounds=2)

    job.answer("site-1", 1.0, 0.9)
    job.answer("site-1", 2.0, 0.5)
    job.finish()

    assert job.errors == []
    assert all("metrics_from_one_site" not in done for done in job.rounds())
    assert job.best_weight() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("counted", "job_clients", "expected"),
    [
        ({"site-1": ["accuracy"]}, 3, ["accuracy"]),
        ({"site-1": ["accuracy"], "site-2": ["accuracy"]}, 3, []),
        ({"site-1": ["accuracy", "loss"], "site-2": ["loss"]}, 2, ["accuracy"]),
        ({"site-1": ["accuracy", "accuracy"]}, 2, ["accuracy"]),
        ({"site-1": ["accuracy"]}, 1, []),
        ({}, 3, []),
    ],
    ids=["one-of-three", "two-of-three", "dropped-at-one", "named-twice-is-one-site", "single-client-job", "none"],
)
def test_metrics_from_one_site(counted: dict[str, list[str]], job_clients: int, expected: list[str]) -> None:
    assert metrics_from_one_site(counted, job_clients) == expected


def test_the_persistor_picks_no_best_by_a_metric_marked_as_one_sites(tmp_path: Path) -> None:
    persistor = PTFileModelPersistor(model=Net(), key_metric="accuracy")
    persistor.use_workspace(tmp_path)
    model = FLModel(params={"fc.weight": torch.ones(1, 2), "fc.bias": torch.zeros(1)}, metrics={"accuracy": 0.99})

    persistor.save_model(marked_from_one_site(model, ["accuracy"]))
    persistor.flush()
    assert not (tmp_path / "models" / "best_global.safetensors").exists()
    persistor.save_model(marked_from_one_site(model, []))  # a later round's list replaces the older one
    persistor.flush()

    assert (tmp_path / "models" / "best_global.safetensors").exists()
    assert MetaKey.METRICS_FROM_ONE_SITE not in marked_from_one_site(marked_from_one_site(model, ["x"]), []).meta
