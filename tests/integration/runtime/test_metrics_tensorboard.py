"""jobs/fedavg with a TensorBoard receiver: what the clients log and the global metrics reach the server's tb/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json

REPO = Path(__file__).resolve().parents[3]


def scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_logged_metrics_and_round_metrics_land_in_a_tensorboard_run_per_site(simulate, tmp_path: Path) -> None:
    job = tmp_path / "fedavg"
    shutil.copytree(REPO / "jobs" / "fedavg", job)
    server_conf = job / "app" / "config" / "config_fed_server.conf"
    text = server_conf.read_text().replace("num_rounds = 3", "num_rounds = 2")
    marker = "components = [\n"
    assert text.count(marker) == 1
    server_conf.write_text(
        text.replace(marker, marker + "  { id = tb, path = engine.metrics.TensorBoardReceiver, args { } }\n")
    )
    client_conf = job / "app" / "config" / "config_fed_client.conf"
    client_conf.write_text(client_conf.read_text().replace("--epochs 2", "--epochs 1"))

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    workspace = tmp_path / "workspace"
    tb = workspace / "server" / "tb"
    assert sorted(p.name for p in tb.iterdir()) == ["server", "site-1", "site-2"]
    for site in ("site-1", "site-2"):  # what each client's script logged, as its own metrics.jsonl says
        logged = [json.loads(line) for line in (workspace / site / "metrics.jsonl").read_text().splitlines()]
        expected = [(line["round"], line["value"]) for line in logged if line["key"] == "local_accuracy"]
        assert [step for step, _ in expected] == [1, 2]
        got = scalars(tb / site, "local_accuracy")
        assert [step for step, _ in got] == [1, 2]
        assert [value for _, value in got] == pytest.approx([value for _, value in expected], abs=1e-6)
    rounds = read_json(workspace / "summary.json")["rounds"]
    global_accuracy = scalars(tb / "server", "global_accuracy")
    assert [step for step, _ in global_accuracy] == [1, 2]
    assert [value for _, value in global_accuracy] == pytest.approx(
        [r["metrics"]["global_accuracy"] for r in rounds], abs=1e-6
    )
    assert not (workspace / "server" / "metrics.jsonl").exists()  # a receiver is configured: only it writes
