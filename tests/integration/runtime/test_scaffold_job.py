"""`flengine run` of jobs/scaffold (its own digits script, with SCAFFOLD's corrected steps), its results downloaded
to disk on the server: the control variates travel both ways, and the model learns the digits."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from safetensors.torch import load_file

from engine.examples.digits import Net, load_split
from engine.runtime.states import JobState

REPO = Path(__file__).resolve().parents[3]


def test_scaffold_job_learns_the_digits_with_its_deltas_downloaded_to_disk(simulate, tmp_path: Path) -> None:
    job = tmp_path / "scaffold"
    shutil.copytree(REPO / "jobs" / "scaffold", job, ignore=shutil.ignore_patterns("__pycache__"))
    server_conf = job / "app" / "config" / "config_fed_server.conf"
    text = server_conf.read_text()
    assert "download_to_disk = false" in text
    server_conf.write_text(text.replace("download_to_disk = false", "download_to_disk = true"))

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    updates = re.findall(r"scaffold control variate updated: round=(\d+) results=(\d+) clients=(\d+) c_norm=(\S+)", log)
    assert [u[:3] for u in updates] == [(str(r), "2", "2") for r in (1, 2, 3)]
    assert all(float(u[3]) > 0 for u in updates)  # the clients' deltas reached c
    assert "refused" not in log
    weights = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    _, (val_x, val_y) = load_split(0, 2)
    net = Net(hidden=64)
    net.load_state_dict(weights)
    accuracy = (net(val_x).argmax(dim=1) == val_y).float().mean().item()
    assert accuracy > 0.85
