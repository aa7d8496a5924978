"""``flengine run -n N -t W``: virtual clients on worker processes, as the server sees real clients.

Each test runs real processes (a server and its workers) over CURVE: clients stay apart on one
worker (name, folder, metrics, saved state, a fresh script loop per task), the same seed gives the
same model with and without workers, a worker killed mid-task costs its clients a round, not the
job, and 10,000 clients on 4 workers train the digits model.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import UsageError
from engine.examples.digits import Net, accuracy, load_split
from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import processes_mentioning, read_json

REPO = Path(__file__).resolve().parents[3]

PROBE_SCRIPT = '''\
"""Records what a virtual client sees, in its own folder; answers with the model it got."""
import json
import os
from pathlib import Path

from engine import client as flare
from engine.model import FLModel

TASKS_IN_THIS_RUN = 0  # a module global: each task's fresh run of the loop starts it at 0


def main():
    global TASKS_IN_THIS_RUN
    flare.init()
    state = flare.client_state()
    while flare.is_running():
        model = flare.receive()
        if model is None:
            break
        TASKS_IN_THIS_RUN += 1
        rounds = state.load("rounds", []) + [model.current_round]
        state.save("rounds", rounds)
        record = {"site": flare.get_site_name(), "job": flare.get_job_id(), "cwd": os.getcwd(),
                  "tasks_in_this_run": TASKS_IN_THIS_RUN, "index": flare.get_site_index(),
                  "sites": flare.get_num_sites()}
        with Path("probe.jsonl").open("a", encoding="utf-8") as stream:  # relative: this client's folder
            stream.write(json.dumps(record) + "\\n")
        flare.log("site_index", float(flare.get_site_index()))
        flare.send(FLModel(params=model.params, meta={"NUM_STEPS_CURRENT_ROUND": 1}))


main()
'''


def fedavg_job(
    tmp_path: Path, *, num_clients: int, num_rounds: int, script: str | None = None, name: str = "fedavg"
) -> Path:
    """A copy of jobs/``name``: seeded sampling, a fixed initial model, ``num_clients`` a round."""
    job = tmp_path / "job"
    shutil.copytree(REPO / "jobs" / name, job)
    torch.manual_seed(0)
    save_file(Net(hidden=64).state_dict(), str(job / "app" / "initial.safetensors"))
    server = job / "app" / "config" / "config_fed_server.conf"
    text = server.read_text(encoding="utf-8")
    text = text.replace("num_clients = 2", f"num_clients = {num_clients}\n      sample_seed = 7")
    text = text.replace("num_rounds = 3", f"num_rounds = {num_rounds}")
    text = text.replace(
        "key_metric = global_accuracy",
        f'key_metric = global_accuracy\n      source_ckpt_file_full_name = "{job / "app" / "initial.safetensors"}"',
    )
    server.write_text(text, encoding="utf-8")
    if script is not None:
        (job / "app" / "custom" / "probe.py").write_text(script, encoding="utf-8")
        client = job / "app" / "config" / "config_fed_client.conf"
        client.write_text(
            client.read_text(encoding="utf-8").replace("task_script_path = train.py", "task_script_path = probe.py"),
            encoding="utf-8",
        )
    return job


def simulate(job: Path, workspace: Path, n: int, workers: int | None) -> tuple[JobState, str, dict]:
    out = io.StringIO()
    result = run_simulation(job, n, workspace, out=out, workers=workers, allowed_dirs=[job])
    assert processes_mentioning(str(workspace)) == []
    return result.state, out.getvalue(), read_json(workspace / "summary.json")


def test_virtual_clients_keep_their_own_name_folder_metrics_and_state(tmp_path: Path) -> None:
    job = fedavg_job(tmp_path, num_clients=6, num_rounds=2, script=PROBE_SCRIPT)

    state, output, summary = simulate(job, tmp_path / "ws", n=6, workers=2)

    assert state is JobState.FINISHED_COMPLETED, output
    assert set(summary["processes"]) == {"server", "worker-1", "worker-2"}  # no process per client
    assert summary["workers"] == 2 and len(summary["clients"]) == 6
    for index in range(6):
        site = f"site-{index + 1}"
        folder = tmp_path / "ws" / site
        records = [json.loads(line) for line in (folder / "probe.jsonl").read_text().splitlines()]
        assert [r["site"] for r in records] == [site, site]
        assert all(r["cwd"] == str(folder) and r["index"] == index and r["sites"] == 6 for r in records)
        assert all(r["job"] == summary["job_id"] for r in records)
        assert [r["tasks_in_this_run"] for r in records] == [1, 1]  # the loop runs afresh for each task
        assert json.loads((folder / "state" / "rounds.json").read_text()) == [0, 1]  # kept across turns
    metrics = [json.loads(line) for line in (tmp_path / "ws" / "server" / "metrics.jsonl").read_text().splitlines()]
    by_site = {m["site"]: m["value"] for m in metrics if m["key"] == "site_index"}
    assert by_site == {f"site-{i + 1}": float(i) for i in range(6)}  # each metric under its own client's name
    log = (tmp_path / "ws" / "worker-1" / "log.txt").read_text()
    assert "[site-1]" in log and "[site-3]" in log and "[site-2]" not in log  # worker-1 runs sites 1, 3, 5


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) for name in ("fedavg", "scaffold", "fedprox")]
)  # end to end, 8 s each; CI runs them with -m slow. SCAFFOLD: each site's c_i kept in its saved state between its turns
def test_the_same_seed_gives_the_same_model_with_workers_and_without(tmp_path: Path, name: str) -> None:
    job = fedavg_job(tmp_path, num_clients=2, num_rounds=3, name=name)

    as_processes = simulate(job, tmp_path / "processes", n=4, workers=None)
    as_virtual = simulate(job, tmp_path / "virtual", n=4, workers=2)

    for state, output, _ in (as_processes, as_virtual):
        assert state is JobState.FINISHED_COMPLETED, output
    assert [r["sampled"] for r in as_processes[2]["rounds"]] == [r["sampled"] for r in as_virtual[2]["rounds"]]
    first = load_file(tmp_path / "processes" / "server" / "models" / "global.safetensors")
    second = load_file(tmp_path / "virtual" / "server" / "models" / "global.safetensors")
    assert max((first[name] - second[name]).abs().max().item() for name in first) < 1e-6


KILLER_SCRIPT = '''\
"""The digits example, except that worker-2 dies (SIGKILL) in the middle of the first task of one of its clients."""
import os
import signal
from pathlib import Path

from engine import client as flare

flare.init()
marker = Path("..") / "worker-2-killed"  # in the run's workspace: once for the whole run
if flare.get_site_index() % 2 == 1 and not marker.exists():  # site-2 and site-4 are worker-2's
    marker.write_text(flare.get_site_name())
    flare.receive()  # the task is taken: the worker dies holding it
    os.kill(os.getpid(), signal.SIGKILL)

from engine.examples.train import main

main()
'''


def test_a_worker_killed_mid_task_costs_its_clients_a_round_and_is_replaced(tmp_path: Path) -> None:
    job = fedavg_job(tmp_path, num_clients=3, num_rounds=3, script=KILLER_SCRIPT)  # 3 of 4: worker-2 is in every round

    state, output, summary = simulate(job, tmp_path / "ws", n=4, workers=2)

    assert state is JobState.FINISHED_COMPLETED, output
    assert (tmp_path / "ws" / "worker-2-killed").read_text() in {"site-2", "site-4"}
    assert summary["worker_restarts"] == {"worker-2": 1}
    assert "worker-2 exited with code -9; starting it again" in output
    assert "worker-2 exited with code -9: its 2 clients are dead" in output  # one line, not one per client
    assert "worker-2 is back: its 2 clients take part from the next round" in output
    dead = {event["site"] for event in summary["site_events"] if event["event"] == "client_dead"}
    back = {event["site"] for event in summary["site_events"] if event["event"] == "client_back"}
    assert dead == back == {"site-2", "site-4"}  # every client of worker-2, none of worker-1's, and back
    assert [len(r["clients"]) for r in summary["rounds"]] == [3, 3, 3]  # every round still had its 3 results
    weights = load_file(tmp_path / "ws" / "server" / "models" / "global.safetensors")
    net = Net(hidden=64)
    net.load_state_dict(weights)
    _, (val_x, val_y) = load_split(0, 4)
    assert accuracy(net, val_x, val_y) > 0.8


def test_swarm_is_refused_on_virtual_clients(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="without -t"):
        run_simulation(REPO / "jobs" / "swarm", 3, tmp_path / "ws", out=io.StringIO(), workers=2)


@pytest.mark.slow
def test_ten_thousand_virtual_clients_on_four_workers_train_the_digits_model(tmp_path: Path) -> None:
    state, output, summary = simulate(REPO / "jobs" / "fedavg", tmp_path / "ws", n=10_000, workers=4)

    assert state is JobState.FINISHED_COMPLETED, output
    assert len(summary["clients"]) == 10_000 and set(summary["processes"]) == {
        "server",
        *(f"worker-{k}" for k in range(1, 5)),
    }
    trained = {site for r in summary["rounds"] for site in r["clients"]}
    assert len(trained) == 6  # 2 a round, 3 rounds, each on its own shard
    assert all((tmp_path / "ws" / site / "state").parent.is_dir() for site in trained)
    weights = load_file(tmp_path / "ws" / "server" / "models" / "global.safetensors")
    net = Net(hidden=64)
    net.load_state_dict(weights)
    _, (val_x, val_y) = load_split(0, 2)
    assert accuracy(net, val_x, val_y) >= 0.85
