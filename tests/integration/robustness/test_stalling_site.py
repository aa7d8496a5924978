"""A site that takes its task but never pulls the task's model: real processes (the simulator).

site-2 of a BenchNet job pauses before it receives its first task (``--fault pause``) and so pulls
nothing, round after round. Each round folds site-1's result after at most ``fold_wait_s`` of
waiting (not the 10 s the server waited before), and from the third round on the round's events
name site-2 ``stalled``.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import in_background, make_bench_job

ROUNDS = 4
FOLD_WAIT_S = 1.0


def _seconds_until(out: io.StringIO, text: str, timeout_s: float) -> float | None:
    """Seconds until ``text`` is on the console; None if it does not come within ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if text in out.getvalue():
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def _release(folder: Path) -> None:
    """Let the paused site go (its script waits for ``.go-site-2`` next to it, in the job's code folder)."""
    for paused in folder.rglob(".paused-site-2"):
        (paused.parent / ".go-site-2").touch()


def test_a_site_that_never_pulls_costs_each_round_a_bounded_slice_and_is_flagged(tmp_path: Path) -> None:
    job = make_bench_job(
        tmp_path,
        num_rounds=ROUNDS,
        num_clients=2,
        min_clients=1,
        script_args="--fault pause --fault-site site-2 --fault-round 0",
        server_extra=f"fold_wait_s = {FOLD_WAIT_S}\n",
    )
    workspace = tmp_path / "ws"
    out = io.StringIO()

    join = in_background(
        lambda: run_simulation(job, 2, workspace, out=out),
    )
    first = _seconds_until(out, f"[round 1/{ROUNDS}] done", 60)
    last = _seconds_until(out, f"[round {ROUNDS}/{ROUNDS}] done", 60)
    _release(tmp_path)  # the job is over: site-2 goes on, hears END_RUN and ends
    result = join()

    assert first is not None and last is not None, out.getvalue()
    # Rounds 2..4 each waited at most fold_wait_s for site-2 (the old wait: ~10 s a round).
    assert last < (ROUNDS - 1) * (FOLD_WAIT_S + 3.0), out.getvalue()
    assert result.state is JobState.FINISHED_COMPLETED, out.getvalue()
    rounds = read_json(workspace / "summary.json")["rounds"]
    assert [entry.get("stalled") for entry in rounds[:2]] == [None, None]
    assert all(entry.get("stalled") == ["site-2"] for entry in rounds[2:]), rounds
    server_log = (workspace / "server" / "log.txt").read_text(encoding="utf-8")
    assert "task data not pulled site=site-2" in server_log
