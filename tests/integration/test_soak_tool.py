"""tools/soak.py for a few rounds in the simulator: its JSON, sane figures, and nothing left behind,
whether the run ends or is interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.runtime.conftest import processes_mentioning

SOAK = Path(__file__).resolve().parents[2] / "tools" / "soak.py"
JOB_PROCESSES = {"simulator", "launcher", "server", "site-1", "site-2"}


def soak(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """The tool with its temp folders under ``tmp_path/tmp``, so a test sees what it leaves there."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.Popen(
        [sys.executable, str(SOAK), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


@pytest.mark.slow  # end to end and long; CI runs it with -m slow
def test_a_short_soak_reports_every_job_process_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"

    process = soak(tmp_path, "--mode", "sim", "--rounds", "12", "--out", str(out))
    stdout, stderr = process.communicate(timeout=120)

    assert process.returncode == 0, stderr
    document = json.loads(out.read_text())
    assert (document["rounds"], document["job_rounds"], document["clients"]) == (12, 13, 2)
    assert {"cpus", "memory_gib", "date"} <= document["machine"].keys()
    (run,) = document["runs"]
    assert (run["mode"], run["status"], run["rounds_done"]) == ("sim", "FINISHED_COMPLETED", 12)
    assert run["sampled_rounds"] >= 8  # rounds that start within one 10 ms poll share a sample
    assert {p["name"] for p in run["processes"]} == JOB_PROCESSES
    for p in run["processes"]:
        assert p["last"]["round"] == 12 and p["window_rounds"] == [p["series"]["round"][0], 12]
        assert 20 < p["last"]["rss_mib"] < 2000 and 3 <= p["last"]["fds"] < 200 and 1 <= p["last"]["threads"] < 200
        assert set(p["slope_per_100_rounds"]) == {"rss_mib", "rss_mib_stderr", "fds", "threads"}
        assert abs(p["slope_per_100_rounds"]["fds"]) < 50  # no fd taken per round
    server = next(p for p in run["processes"] if p["name"] == "server")
    assert isinstance(server["within_goal"], bool)
    assert "| sim | server |" in stdout and "sim: FINISHED_COMPLETED" in stdout
    assert list((tmp_path / "tmp").glob("flengine-soak-*")) == []  # torch may leave its own cache there
    assert processes_mentioning(str(tmp_path / "tmp")) == []


def test_ctrl_c_stops_the_run_and_removes_its_folder(tmp_path: Path) -> None:
    process = soak(tmp_path, "--mode", "sim", "--rounds", "100000")
    deadline = time.monotonic() + 60
    while not any("engine.runtime.entry" in line for line in processes_mentioning(str(tmp_path / "tmp"))):
        assert time.monotonic() < deadline and process.poll() is None, "the job's processes never started"
        time.sleep(0.2)

    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 130, stderr
    assert "soak: interrupted; stopping what it started" in stderr
    assert processes_mentioning(str(tmp_path / "tmp")) == []
    assert list((tmp_path / "tmp").glob("flengine-soak-*")) == []  # torch may leave its own cache there
