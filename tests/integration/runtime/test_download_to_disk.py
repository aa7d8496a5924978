"""download_to_disk in real jobs: the same model with it on and off, nothing left on disk, and
the faults (disk full, a client killed mid-upload, a crashed server's leftovers)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import expected_delta, in_background, kill_when_a_download_starts, make_bench_job


def initial_model(job: Path, layers: int, width: int) -> dict[str, torch.Tensor]:
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        return {name: t.detach().clone() for name, t in BenchNet(layers=layers, width=width).state_dict().items()}


@pytest.mark.parametrize(
    ("workflow", "on"),
    [("fedavg", False), ("fedavg", True), ("sag", True)],
    ids=["fedavg-off", "fedavg-on", "sag-on"],
)
def test_the_model_is_the_analytic_one_on_and_off_and_no_file_is_left(
    simulate, tmp_path: Path, workflow: str, on: bool
) -> None:
    job = make_bench_job(
        tmp_path,
        num_rounds=2,
        layers=2,
        width=64,
        chunk_bytes=4096,
        workflow=workflow,
        workflow_args={"download_to_disk": on},
    )
    initial = initial_model(job, 2, 64)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    for name, tensor in initial.items():
        expected = tensor.double() + 2 * expected_delta(2)
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    downloads = tmp_path / "workspace" / "server" / "downloads"
    if on:  # every round ended with nothing on disk, and the folder is gone with the job
        assert [(r["disk_downloads"], r["disk_bytes_left"]) for r in rounds] == [(2, 0), (4, 0)]
        assert list(downloads.iterdir()) == []
        log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
        assert "downloads go to disk" in log
    else:
        assert all("disk_bytes_left" not in r for r in rounds) and not downloads.exists()


BIG = {"layers": 1, "width": 4096, "chunk_bytes": 16384}  # 64 MiB in 16 KiB chunks: a slow upload


def test_a_client_killed_mid_upload_leaves_no_partial_file(simulate, tmp_path: Path) -> None:
    job = make_bench_job(
        tmp_path,
        num_rounds=1,
        min_clients=1,
        script_args="--fault sleep --fault-site site-1 --sleep-s 3",
        workflow_args={"download_to_disk": True},
        **BIG,
    )
    downloads = tmp_path / "workspace" / "server" / "downloads"
    finished = in_background(simulate, job)

    killed = kill_when_a_download_starts(downloads, str(tmp_path), "--site site-2")  # site-1 is still asleep
    result, output = finished()

    assert killed, output
    assert result.state is JobState.FINISHED_COMPLETED, output
    [round_done] = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert round_done["clients"] == ["site-1"] and "site-2" in round_done["failed"]
    assert (round_done["disk_downloads"], round_done["disk_bytes_left"]) == (2, 0)  # the partial one went at once
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text()
    assert "result of site-2 for task 'train' refused" in log
    assert "downloads left at the end deleted" not in log


def test_the_next_run_sweeps_what_a_crashed_server_left(simulate, tmp_path: Path) -> None:
    shared = tmp_path / "scratch"
    crashing = make_bench_job(
        tmp_path / "first",
        num_rounds=1,
        workflow_args={"download_to_disk": True, "download_to_disk_dir": str(shared)},
        **BIG,
    )
    finished = in_background(simulate, crashing, None, [shared])  # a folder outside the workspace: allowed
    assert kill_when_a_download_starts(shared, str(tmp_path / "first"), "entry server")
    crashed, _ = finished()
    [leftover] = shared.glob("run-*")
    assert crashed.state is not JobState.FINISHED_COMPLETED and any(leftover.glob("xfer-*"))

    job = make_bench_job(
        tmp_path / "second",
        num_rounds=1,
        workflow_args={"download_to_disk": True, "download_to_disk_dir": str(shared)},
    )
    result, output = run_simulation_in(job, tmp_path / "second" / "workspace", allowed_dirs=[shared])

    assert result.state is JobState.FINISHED_COMPLETED, output
    assert not leftover.exists() and list(shared.iterdir()) == []
    log = (tmp_path / "second" / "workspace" / "server" / "log.txt").read_text()
    assert f"leftover downloads of crashed runs deleted: root={shared} folders=1" in log


def run_simulation_in(job: Path, workspace: Path, allowed_dirs: list[Path]):
    out = io.StringIO()
    return run_simulation(job, None, workspace, out=out, allowed_dirs=allowed_dirs), out.getvalue()


def test_a_full_disk_fails_the_result_with_the_folder_and_bytes_and_leaves_nothing(
    simulate, tmp_path: Path, small_disk: Path
) -> None:
    job = make_bench_job(  # 2 MiB results, a 1 MiB disk
        tmp_path,
        num_rounds=1,
        layers=1,
        width=724,
        chunk_bytes=65536,
        workflow_args={"download_to_disk": True, "download_to_disk_dir": str(small_disk)},
    )

    result, output = simulate(job, allowed_dirs=[small_disk])

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    reason = read_json(tmp_path / "workspace" / "summary.json")["reason"]
    assert "0 usable result(s), 2 needed (min_clients)" in reason
    assert re.search(rf"cannot reserve \d+ bytes in {small_disk}/run-\d+-\w+/xfer-\w+ for a download", reason), reason
    assert "No space left on device" in reason
    assert list(small_disk.iterdir()) == []
