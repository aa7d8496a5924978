"""How long a run spends outside its rounds: each stage is in summary.json, in order, and ``-v`` prints them.

Only the order is checked, never absolute times: the machine that runs the tests is shared.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from engine.runtime.timings import CONCURRENT, STAGES
from tests.integration.runtime.conftest import processes_mentioning, read_json
from tests.integration.runtime.jobkit import make_bench_job


def test_every_stage_of_a_run_is_reported_in_order_and_printed_with_v(tmp_path: Path) -> None:
    job = make_bench_job(tmp_path, num_rounds=2)
    out = io.StringIO()

    result = run_simulation(job, None, tmp_path / "workspace", out=out, verbose=True, live=False)

    assert result.state is JobState.FINISHED_COMPLETED, out.getvalue()
    timings = read_json(tmp_path / "workspace" / "summary.json")["timings"]
    stages = timings["stages"]
    assert list(stages) == list(STAGES)  # every stage reached, in this order
    in_order = [stages[stage] for stage in STAGES if stage not in CONCURRENT]
    assert in_order == sorted(in_order) and in_order[0] > 0
    for stage in CONCURRENT:  # the server and the clients start together, after the launcher's imports
        assert stages["launcher_ready"] <= stages[stage] <= stages["clients_registered"]
    assert set(timings["clients_ready"]) == {"site-1", "site-2"}
    assert max(timings["clients_ready"].values()) == stages["clients_ready"]
    rounds_s = stages["last_round_done"] - stages["first_round_started"]
    assert abs(timings["outside_rounds_s"] - (stages["summary_written"] - rounds_s)) < 0.01
    printed = out.getvalue()
    assert "timing (seconds since the run started" in printed
    assert all(f"  {stage} " in printed for stage in STAGES)
    assert processes_mentioning(str(tmp_path)) == []


def test_a_client_waiting_for_its_endpoint_on_stdin_exits_quietly_when_stdin_closes(tmp_path: Path) -> None:
    job = make_bench_job(tmp_path, num_rounds=1)
    command = [
        sys.executable, "-m", "engine.runtime.entry", "client", "--job", str(job),
        "--workspace", str(tmp_path / "workspace"), "--site", "site-1", "--insecure", "--connect", "-",
    ]  # fmt: skip

    done = subprocess.run(command, input=b"", capture_output=True, timeout=120)

    assert done.returncode == 0, done.stderr  # the server never listened: this client was never part of a run
    folder = tmp_path / "workspace" / "site-1"
    assert (
        "no server endpoint on stdin (--connect -): the run ended before the server listened"
        in (folder / "log.txt").read_text()
    )
    assert '"event": "client_ready"' in (folder / "events.jsonl").read_text()  # its executors were built first
    assert read_json(folder / "process.json")["tasks_done"] == 0
