"""Paths from a job stay where the site allows, in real runs: a refused path ends the run with a
reason that names the setting (never a hang), and a folder the site allows with ``--allow-dir``
is used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cli import main
from engine.config import job_code_on_path
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import processes_mentioning, read_json
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

PERSISTOR = "path = engine.persistors.PTFileModelPersistor, args {"


def starting_from(job: Path, source: str) -> Path:
    """Give the job's persistor ``source_ckpt_file_full_name = source``."""
    config = job / "app" / "config" / "config_fed_server.conf"
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace(PERSISTOR, f"{PERSISTOR} source_ckpt_file_full_name = {json.dumps(source)},"))
    return job


@pytest.mark.parametrize("folder", ["../../escape", "{tmp}/elsewhere"], ids=["dot-dot", "absolute-outside"])
def test_a_download_folder_outside_the_workspace_fails_the_run_naming_the_setting(
    simulate, tmp_path: Path, folder: str
) -> None:
    folder = folder.format(tmp=tmp_path)
    job = make_bench_job(
        tmp_path, num_rounds=1, workflow_args={"download_to_disk": True, "download_to_disk_dir": folder}
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    reason = read_json(tmp_path / "workspace" / "summary.json")["reason"]
    # Refused at job start, before the first round, at the file and line that set it.
    assert reason.startswith("ConfigError: "), reason
    assert f"config_fed_server.conf:5: workflows[0].args.download_to_disk_dir: {folder!r} leads to " in reason
    assert reason.endswith("or let the site allow a folder that holds it (flengine run --allow-dir DIR)"), reason
    assert not (tmp_path / "escape").exists() and not (tmp_path / "elsewhere").exists()


def test_flengine_run_allow_dir_lets_downloads_go_to_that_folder(tmp_path: Path, capsys) -> None:
    scratch = tmp_path / "scratch"
    job = make_bench_job(
        tmp_path, num_rounds=1, workflow_args={"download_to_disk": True, "download_to_disk_dir": str(scratch / "dl")}
    )
    workspace = tmp_path / "workspace"

    code = main(["run", str(job), "--workspace", str(workspace), "--allow-dir", str(scratch)])

    assert code == 0, capsys.readouterr()
    [round_done] = read_json(workspace / "summary.json")["rounds"]
    assert (round_done["disk_downloads"], round_done["disk_bytes_left"]) == (2, 0)
    assert f"downloads go to disk: folder={scratch / 'dl'}/run-" in (workspace / "server" / "log.txt").read_text()
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.parametrize("source", ["/etc/passwd", "../../x.safetensors"], ids=["a-system-file", "dot-dot"])
def test_a_source_checkpoint_outside_the_job_fails_the_run_at_start(simulate, tmp_path: Path, source: str) -> None:
    job = starting_from(make_bench_job(tmp_path, num_rounds=1), source)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    reason = read_json(tmp_path / "workspace" / "summary.json")["reason"]
    assert "config_fed_server.conf:" in reason, reason
    assert f": components[0].args.source_ckpt_file_full_name: {source!r} leads to " in reason, reason
    assert "outside the job folder, the site's workspace and the folders the site allows" in reason
    # The clients start with the server, but one that fails at start gives them no endpoint to connect to.
    assert "registered with server" not in (tmp_path / "workspace" / "site-1" / "log.txt").read_text()


def test_a_source_checkpoint_inside_the_job_folder_is_where_the_run_starts(simulate, tmp_path: Path) -> None:
    job = starting_from(make_bench_job(tmp_path, num_rounds=1, layers=2, width=32), "custom/start.safetensors")
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        start = {name: torch.full_like(t, 0.5) for name, t in BenchNet(layers=2, width=32).state_dict().items()}
    save_file(start, job / "app" / "custom" / "start.safetensors")

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    for name, tensor in start.items():
        expected = tensor.double() + expected_delta(2)
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name
