"""The round loop and dead sites, against a real task queue with the test playing the clients and
the runtime's liveness: a dead site is not sampled, one that dies mid-round is replaced, a round
left short is played again, too few live sites wait ``site_wait_timeout`` and then end the job
naming them, a site that comes back is sampled again."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.controller import SubmitOutcome, TaskQueue
from engine.controller.context import JobContext
from engine.errors import WorkflowError
from engine.model import FLModel, ParamsType, ReturnCode
from engine.model.convert import shareable_from_model
from engine.persistors import PTFileModelPersistor
from engine.workflows import FedAvg, ScatterAndGather
from engine.workflows.round_sites import check_site_wait_timeout

CLIENTS = ["site-1", "site-2", "site-3"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)
        with torch.no_grad():
            self.fc.weight.fill_(1.0)
            self.fc.bias.fill_(0.0)


class Liveness:
    """The runtime's side: who is dead and why; `die` also tells the queue, as the server job does."""

    def __init__(self, queue: TaskQueue) -> None:
        self.queue = queue
        self.dead: dict[str, str] = {}
        self.lock = threading.Lock()

    def __call__(self) -> dict[str, str]:
        with self.lock:
            return dict(self.dead)

    def die(self, site: str, why: str = "its process exited with code -9") -> None:
        with self.lock:
            self.dead[site] = why
        self.queue.client_dead(site)

    def back(self, site: str) -> None:
        with self.lock:
            self.dead.pop(site, None)
        self.queue.client_back(site)


class Run:
    def __init__(self, tmp_path: Path, workflow: FedAvg | ScatterAndGather, components: dict | None = None) -> None:
        self.queue = TaskQueue(CLIENTS)
        self.liveness = Liveness(self.queue)
        self.persistor = PTFileModelPersistor(model=Net())
        self.persistor.use_workspace(tmp_path)
        self.events: list[tuple[str, dict]] = []
        self.errors: list[BaseException] = []
        self.workflow = workflow
        context = JobContext(
            workspace=tmp_path,
            components={"persistor": self.persistor, **(components or {})},
            report=lambda event, **fields: self.events.append((event, fields)),
            dead_clients=self.liveness,
        )
        workflow.bind(self.queue, context=context)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.workflow.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.errors.append(e)

    def start(self) -> Run:
        self.thread.start()
        return self

    def task_of(self, client: str, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assignment = self.queue.next_task(client)
            if assignment is not None:
                return assignment
            time.sleep(0.01)
        raise AssertionError(f"{client} got no task")

    def no_task_for(self, client: str, seconds: float = 0.3) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.queue.next_task(client) is not None:
                return False
            time.sleep(0.01)
        return True

    def answer(self, client: str, value: float, assignment=None) -> None:
        assignment = assignment or self.task_of(client)
        result = shareable_from_model(
            FLModel(
                params={"fc.weight": torch.full((1, 2), value), "fc.bias": torch.zeros(1)},
                params_type=ParamsType.FULL,
                meta={"NUM_STEPS_CURRENT_ROUND": 1},
            )
        )
        result.set_return_code(ReturnCode.OK)
        self.queue.submit(client, assignment.task_id, result)

    def events_named(self, name: str) -> list[dict]:
        return [fields for event, fields in self.events if event == name]

    def finish(self, timeout_s: float = 20.0) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive()
        self.queue.end_run()


def sampled_rounds(seed: int, rounds: int, live: list[str], count: int = 2) -> list[list[str]]:
    rng = random.Random(seed)
    return [sorted(rng.sample(live, count)) for _ in range(rounds)]


def test_a_dead_site_is_never_sampled(tmp_path: Path) -> None:
    run = Run(tmp_path, FedAvg(num_clients=2, num_rounds=3, sample_seed=5))
    run.liveness.die("site-3")
    run.start()

    for _ in range(3):
        run.answer("site-1", 1.0)
        run.answer("site-2", 3.0)
    run.finish()

    assert run.errors == []
    done = run.events_named("round_done")
    assert [d["sampled"] for d in done] == [["site-1", "site-2"]] * 3
    assert all(d["dead"] == {"site-3": "its process exited with code -9"} for d in done)
    assert torch.allclose(run.persistor.load_model().params["fc.weight"], torch.full((1, 2), 2.0))


def test_a_site_that_dies_mid_round_is_replaced_by_a_live_one_and_the_round_completes(tmp_path: Path) -> None:
    seed = next(s for s in range(100) if sampled_rounds(s, 1, CLIENTS)[0] == ["site-1", "site-3"])
    run = Run(tmp_path, FedAvg(num_clients=2, num_rounds=1, sample_seed=seed)).start()

    run.answer("site-1", 1.0)
    assert run.no_task_for("site-2")  # not sampled: it waits
    run.task_of("site-3")  # site-3 took the task, then its process dies
    run.liveness.die("site-3")
    run.answer("site-2", 3.0)  # the replacement
    run.finish()

    assert run.errors == []
    (done,) = run.events_named("round_done")
    assert done["clients"] == ["site-1", "site-2"]
    assert done["replacements"] == ["site-2"]
    assert done["sampled"] == ["site-1", "site-3", "site-2"]
    assert done["failed"]["site-3"].startswith("CLIENT_DEAD")
    assert run.events_named("round_replacements") == [{"round": 0, "lost": ["site-3"], "drawn": ["site-2"]}]
    assert torch.allclose(run.persistor.load_model().params["fc.weight"], torch.full((1, 2), 2.0))


def test_a_round_left_short_by_a_death_is_played_again_once_the_site_is_back(tmp_path: Path) -> None:
    # All three are asked (no sampling): nobody can replace site-3, the round is played again.
    run = Run(tmp_path, FedAvg(num_clients=3, num_rounds=1, site_wait_timeout=10)).start()

    first = run.task_of("site-3")
    run.liveness.die("site-3")
    run.answer("site-1", 1.0)
    run.answer("site-2", 2.0)
    deadline = time.monotonic() + 5
    while not run.events_named("waiting_for_sites") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.events_named("waiting_for_sites")[0]["dead"] == {"site-3": "its process exited with code -9"}
    run.liveness.back("site-3")  # its job process was restarted
    for site, value in (("site-1", 1.0), ("site-2", 2.0), ("site-3", 6.0)):
        run.answer(site, value)
    late = shareable_from_model(FLModel(params={}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    late.set_return_code(ReturnCode.OK)
    assert run.queue.submit("site-3", first.task_id, late) is SubmitOutcome.LATE  # its first task ended
    run.finish()

    assert run.errors == []
    retried = run.events_named("round_retried")
    assert [r["lost"] for r in retried] == [["site-3"]]
    (done,) = run.events_named("round_done")
    assert done["clients"] == ["site-1", "site-2", "site-3"] and "dead" not in done
    assert torch.allclose(run.persistor.load_model().params["fc.weight"], torch.full((1, 2), 3.0))


def test_too_few_live_sites_end_the_job_after_site_wait_timeout_naming_them(tmp_path: Path) -> None:
    run = Run(tmp_path, FedAvg(num_clients=2, num_rounds=2, sample_seed=1, site_wait_timeout=0.5))
    run.liveness.die("site-2")
    run.liveness.die("site-3", "no heartbeat for 10 s")
    started = time.monotonic()
    run.start()
    run.finish()

    assert time.monotonic() - started >= 0.5
    (error,) = run.errors
    assert isinstance(error, WorkflowError)
    assert str(error) == (
        "round 1: 1 of 3 sites alive, 2 needed (min_clients); dead: site-2 (its process exited with code -9), "
        "site-3 (no heartbeat for 10 s); none came back within 0.5 s (site_wait_timeout)"
    )
    assert run.events_named("round_started") == []


def test_a_site_that_comes_back_while_the_loop_waits_lets_the_round_start(tmp_path: Path) -> None:
    run = Run(tmp_path, FedAvg(num_clients=2, num_rounds=1, min_clients=2, sample_seed=3, site_wait_timeout=30))
    run.liveness.die("site-2")
    run.liveness.die("site-3")
    run.start()
    deadline = time.monotonic() + 5
    while not run.events_named("waiting_for_sites") and time.monotonic() < deadline:
        time.sleep(0.01)

    run.liveness.back("site-2")
    run.answer("site-1", 1.0)
    run.answer("site-2", 3.0)
    run.finish()

    assert run.errors == []
    assert run.events_named("sites_back")[0]["alive"] == ["site-1", "site-2"]
    assert run.events_named("round_done")[0]["sampled"] == ["site-1", "site-2"]


def test_a_site_back_is_sampled_again_from_the_next_round(tmp_path: Path) -> None:
    run = Run(tmp_path, FedAvg(num_clients=3, num_rounds=2, min_clients=2))
    run.liveness.die("site-3")
    run.start()
    run.answer("site-1", 1.0)
    second = run.task_of("site-2")
    run.liveness.back("site-3")  # it rejoins during round 1, which did not ask it: round 2 does
    assert run.no_task_for("site-3")
    run.answer("site-2", 1.0, second)
    tasks = {site: run.task_of(site) for site in CLIENTS}  # all three before two answers end the round
    for site in CLIENTS:
        run.answer(site, 1.0, tasks[site])
    run.finish()

    assert run.errors == []
    done = run.events_named("round_done")
    assert [d["sampled"] for d in done] == [["site-1", "site-2"], CLIENTS]


def test_scatter_and_gather_asks_the_live_sites_only(tmp_path: Path) -> None:
    from engine.aggregators import DXOAggregator
    from engine.workflows import FullModelShareableGenerator

    components = {
        "aggregator": DXOAggregator(expected_data_kind="WEIGHTS"),
        "shareable_generator": FullModelShareableGenerator(),
    }
    run = Run(tmp_path, ScatterAndGather(min_clients=2, num_rounds=1, wait_time_after_min_received=0), components)
    run.liveness.die("site-1")
    run.start()
    assert run.no_task_for("site-1")
    run.answer("site-2", 1.0)
    run.answer("site-3", 3.0)
    run.finish()

    assert run.errors == []
    assert run.events_named("round_done")[0]["sampled"] == ["site-2", "site-3"]


@pytest.mark.parametrize("value", [-1, "10", True, float("nan")], ids=["negative", "string", "bool", "nan"])
def test_site_wait_timeout_must_be_seconds(value: object) -> None:
    with pytest.raises(ValueError, match="site_wait_timeout: expected a number of seconds >= 0"):
        check_site_wait_timeout(value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="site_wait_timeout"):
        FedAvg(site_wait_timeout=value)  # type: ignore[arg-type]
