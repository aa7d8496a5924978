"""Status that tells the truth in production mode, measured from outside with real daemons: a job's
record is final within 2 s of its server process's end, with the reason; a site whose daemon died
is not shown connected once it missed its status reports; a download waits for the sites' results."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.deploy import protocol
from engine.deploy.admin import AdminSession
from engine.provision import load_kit
from tests.integration.deploy.test_production import SITES, Deployment, deployment  # noqa: F401
from tests.integration.runtime.jobkit import make_bench_job, pids_of

FINAL = ("FINISHED_COMPLETED", "FINISHED_EXECUTION_EXCEPTION", "FINISHED_ABORTED", "FINISHED_REJECTED")


@pytest.fixture
def alice(deployment: Deployment) -> Iterator[AdminSession]:  # noqa: F811
    deployment.start("server", "server")
    for site in SITES:
        deployment.start(site, "client")
    deployment.wait_connected(*SITES)
    with AdminSession(load_kit(deployment.kits / "alice")) as session:  # polls without a process each
        yield session


def _until(condition, timeout_s: float, step_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError(f"not within {timeout_s} s")


def test_a_failed_job_is_final_within_2_s_of_its_server_process_end(
    deployment: Deployment,  # noqa: F811
    alice: AdminSession,
    tmp_path: Path,
) -> None:
    job = make_bench_job(tmp_path / "jobs", num_rounds=2, script_args="--fault raise --fault-site site-2")
    job_id = alice.submit(job)["job_id"]
    (server,) = _until(lambda: pids_of("entry server", job_id), 60)

    _until(lambda: not pids_of("entry server", job_id), 60, step_s=0.01)
    ended = time.monotonic()
    record = _until(lambda: (r := alice.command("status", job_id=job_id))["status"] in FINAL and r, 10)

    assert time.monotonic() - ended < 2.0
    assert record["status"] == "FINISHED_EXECUTION_EXCEPTION"
    assert "injected failure on site-2" in record["reason"]
    assert record["finished_at"] is not None
    # the sites hand in their results within seconds; a download waits for them, then has them all
    _until(lambda: not alice.command("status", job_id=job_id)["results_pending"], 40)


def test_a_site_whose_daemon_died_is_not_shown_connected(
    deployment: Deployment,  # noqa: F811
    alice: AdminSession,
) -> None:
    daemon = deployment.daemons.pop("site-2")
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.wait(10)
    killed = time.monotonic()

    _until(lambda: [e for e in alice.command("clients") if e["site"] == "site-2" and not e["connected"]], 20)

    assert time.monotonic() - killed <= protocol.STATUS_TIMEOUT_S + 1.0
    entry = next(e for e in alice.command("clients") if e["site"] == "site-1")
    assert entry["connected"]
