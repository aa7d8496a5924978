"""Config files parsed from several threads at once (a server daemon's submits and scheduler) parse right."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

from engine.config import inspect_job

FEDAVG = Path(__file__).resolve().parents[3] / "jobs" / "fedavg"


def test_jobs_inspected_from_eight_threads_at_once_all_parse() -> None:
    def inspect(_: int) -> list[str]:
        job, problems = inspect_job(FEDAVG, build=False, environment=False)
        return [str(p) for p in problems] if job is None else []

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        failures = [problems for problems in pool.map(inspect, range(64)) if problems]

    assert failures == []
