"""A bug in a workflow's own result check is the server's fault, never a site's refusal (real processes).

The job's workflow is FedAvg with a ``check_result`` that raises a plain ValueError for site-2's
result: the bug. In memory mode results are folded as they stream in, and the check first runs
on the result's layout, before any chunk is pulled: site-2's result fails there, is reported in
the round's ``failed`` (never ``refused``) with a reason that says the check has a bug, the server
log holds the traceback, and the round goes on with site-1's result (``min_clients = 1``).
"""

from __future__ import annotations

from pathlib import Path

from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import make_bench_job

BUGGY = """
from typing import Any

from engine.model import FLModel
from engine.workflows import FedAvg


class BuggyCheck(FedAvg):
    def check_result(self, result: FLModel, client: str, current_round: int, reference: dict[str, Any]) -> None:
        super().check_result(result, client, current_round, reference)
        if client == "site-2":
            raise ValueError("math domain error")  # a bug, say a log() of a zero meant for another metric
"""


def test_a_bug_in_a_custom_check_fails_the_result_with_its_traceback_and_the_round_goes_on(
    simulate, tmp_path: Path
) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, num_clients=2, min_clients=1, chunk_bytes=4096)
    (job / "app" / "custom" / "buggy_check.py").write_text(BUGGY, encoding="utf-8")
    server = job / "app" / "config" / "config_fed_server.conf"
    server.write_text(
        server.read_text(encoding="utf-8").replace("engine.workflows.FedAvg", "buggy_check.BuggyCheck"),
        encoding="utf-8",
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    (round_done,) = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert round_done["clients"] == ["site-1"]
    assert round_done["refused"] == {}
    assert round_done["failed"]["site-2"] == (
        "checking the result raised ValueError: math domain error (a bug in the server's checks, not a refusal by "
        "the site; the traceback is in the server's log)"
    )
    log = (tmp_path / "workspace" / "server" / "log.txt").read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in log and 'raise ValueError("math domain error")' in log, log[-3000:]
    assert "result refused: site=site-2" not in log
    assert "result of site-2 for task 'train' failed on the server: ValueError: math domain error" in log
