"""The digits example's training script (`engine.examples.train`) at sites named unlike ``site-N``.

The script runs for real in a thread, served by an `InProcessBackend` as a job's in-process
executor serves it; the test plays the server: it hands tasks in and reads the results.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import pytest
import torch

from engine.client.backends import InProcessBackend, install_backend
from engine.client.exchange import TaskExchange
from engine.examples import train
from engine.examples.digits import Net, accuracy, load_split
from engine.model import FLModel

#: Longest the test waits for one result of the script.
RESULT_WAIT_S = 60.0
HIDDEN = 16


class Site:
    """The example script running as ``site`` of a job with ``job_sites``; `end` stops it."""

    def __init__(self, site: str, job_sites: list[str], argv: list[str]) -> None:
        self.exchange = TaskExchange()
        self.backend = InProcessBackend(self.exchange, site, "job-1", job_sites=job_sites)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(argv,), daemon=True)
        self.thread.start()

    def _run(self, argv: list[str]) -> None:
        install_backend(self.backend, this_thread_only=True)
        try:
            train.main(argv)
        except BaseException as e:  # reported by the test, not lost in the thread
            self.error = e

    def task(self, name: str, model: FLModel) -> FLModel:
        self.exchange.put_task(name, model)
        result = self.exchange.take_result(RESULT_WAIT_S)
        assert result is not None, f"no result for {name}; the script raised {self.error!r}"
        return result

    def end(self) -> None:
        self.exchange.end()
        self.thread.join(RESULT_WAIT_S)
        assert not self.thread.is_alive() and self.error is None, self.error


@pytest.fixture
def start() -> Iterator:
    torch_threads = torch.get_num_threads()  # the script sets 1 for the whole process
    sites: list[Site] = []

    def make(site: str, job_sites: list[str]) -> Site:
        sites.append(Site(site, job_sites, ["--epochs", "1", "--hidden", str(HIDDEN)]))
        return sites[-1]

    yield make
    for site in sites:
        site.exchange.end()
        site.thread.join(RESULT_WAIT_S)
    torch.set_num_threads(torch_threads)


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: t.detach().clone() for name, t in Net(hidden=HIDDEN).state_dict().items()}


@pytest.mark.parametrize(
    ("site", "job_sites", "shard"),
    [
        pytest.param("lab-c", ["hospital-b", "lab-a", "lab-c"], 2, id="lab-c-the-issue's-site"),
        pytest.param("hospital-b", ["hospital-b", "lab-a"], 0, id="hospital-b"),
        pytest.param("site-2", ["site-2", "site-9"], 0, id="site-N-by-position-not-number"),
    ],
)
def test_each_site_trains_and_validates_on_the_shard_of_its_position(
    start, site: str, job_sites: list[str], shard: int
) -> None:
    (train_x, train_y), (val_x, val_y) = load_split(shard, len(job_sites))
    running = start(site, job_sites)

    trained = running.task("train", FLModel(params=weights()))
    trained_params = {name: t.detach().clone() for name, t in trained.params.items()}
    validated = running.task("validate", FLModel(params=trained_params))
    submitted = running.task("submit_model", FLModel())
    running.end()

    assert trained.meta["NUM_STEPS_CURRENT_ROUND"] == math.ceil(len(train_y) / 32)  # one epoch of this shard
    assert trained.metrics["global_accuracy"] < trained.metrics["local_accuracy"]
    net = Net(hidden=HIDDEN)
    net.load_state_dict(trained_params)
    mine = slice(shard, None, len(job_sites))
    assert validated.metrics == {"accuracy": pytest.approx(accuracy(net, val_x[mine], val_y[mine]))}
    assert submitted.params.keys() == trained_params.keys()
    assert all(torch.equal(submitted.params[name], t) for name, t in trained_params.items())


def test_a_site_of_a_job_whose_sites_are_unknown_fails_with_the_fix(start) -> None:
    running = start("lab-c", [])

    running.thread.join(RESULT_WAIT_S)

    assert "the job's sites are unknown to lab-c" in str(running.error)
