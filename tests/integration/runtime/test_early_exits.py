"""A client process that dies before the job starts ends the run at once, with its last error lines."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import make_bench_job

BROKEN = '''\
"""Job code that fails at start on one site."""
import os

from engine.executors.executor import Executor


def _fail_on_site_2(where: str) -> None:
    if os.path.basename(os.getcwd()) == "site-2":
        raise RuntimeError(f"cannot open /data/site-2/shard.csv ({where})")


class BrokenComponent:
    def __init__(self) -> None:
        _fail_on_site_2("component")


class BrokenExecutor(Executor):
    def initialize(self, context) -> None:
        _fail_on_site_2("executor")

    def execute(self, task_name, shareable, abort_signal):
        return shareable
'''

BEFORE_CONNECTING = "components = [{ id = broken, path = broken.BrokenComponent }]\n"
AFTER_CONNECTING = 'executors = ${executors} [{ tasks = ["never"], executor { path = broken.BrokenExecutor } }]\n'


@pytest.mark.parametrize(
    ("client_extra", "where"),
    [(BEFORE_CONNECTING, "component"), (AFTER_CONNECTING, "executor")],
    ids=["before-connecting", "after-connecting"],
)
def test_a_client_that_dies_at_start_ends_the_run_at_once_with_its_error(
    simulate, tmp_path: Path, client_extra: str, where: str
) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, client_extra=client_extra)
    (job / "app" / "custom" / "broken.py").write_text(BROKEN)
    started = time.monotonic()

    result, output = simulate(job)

    seconds = time.monotonic() - started
    error = f"RuntimeError: cannot open /data/site-2/shard.csv ({where})"
    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    assert seconds < 30, f"the run took {seconds:.0f} s:\n{output}"
    assert any(line.startswith("  site-2: ") and error in line for line in output.splitlines()), output
    assert "never connected" not in output
    reason = read_json(tmp_path / "workspace" / "summary.json")["reason"]
    assert reason.startswith("the site-2 process exited (code 1) before the job started: "), reason
    assert error in reason and reason.endswith("site-2/stderr.txt"), reason
