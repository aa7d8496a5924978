"""The digits example in production mode at sites named unlike ``site-N`` (``hospital-b``, ``lab-a``).

Each site's training script takes the shard of its place among the job's sites, which the server
daemon hands every site with the deployment: nothing parses a site's name (issue 36: a site named
``lab-c`` failed the job with ``ValueError: invalid literal for int()``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.deploy.test_production import ROOT, Deployment

#: As a project would name them; the scheduler places a job for "@ALL" on them in sorted order.
SITES = ("lab-a", "hospital-b")


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path)
    deployment.provision(SITES, remove=True)  # the project of site-1 and site-2 becomes one of these two
    try:
        yield deployment
    finally:
        deployment.close()
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    for pid in leftovers:
        os.kill(int(pid), signal.SIGKILL)
    assert not leftovers, "job processes outlived their daemons"


def one_round_of_jobs_fedavg(folder: Path) -> Path:
    job = shutil.copytree(ROOT / "jobs" / "fedavg", folder, ignore=shutil.ignore_patterns("__pycache__"))
    server = job / "app" / "config" / "config_fed_server.conf"
    server.write_text(re.sub(r"num_rounds = \d+", "num_rounds = 1", server.read_text()))
    return job


@pytest.mark.slow  # end to end and long; CI runs it with -m slow
def test_the_example_job_trains_at_sites_named_unlike_site_n(deployment: Deployment, tmp_path: Path) -> None:
    job = one_round_of_jobs_fedavg(tmp_path / "fedavg")
    deployment.start("server", "server")
    for site in SITES:
        deployment.start(site, "client")
    deployment.wait_connected(*SITES)

    job_id = deployment.admin_json("alice", "submit", str(job))["job_id"]
    record = deployment.wait_status(job_id, "FINISHED_COMPLETED", "FINISHED_EXECUTION_EXCEPTION", timeout_s=180)

    assert record["status"] == "FINISHED_COMPLETED", record
    assert sorted(record["sites"]) == sorted(SITES)
    assert deployment.admin("alice", "download", job_id, "-o", str(tmp_path / "results")).returncode == 0
    results = tmp_path / "results" / job_id
    for index, site in enumerate(sorted(SITES)):
        log = (results / site / "log.txt").read_text()
        assert f"job sites site={site} index={index} of=2 sites=hospital-b,lab-a" in log
        assert "ValueError" not in log
        metrics = (results / site / "metrics.jsonl").read_text()
        assert '"key": "local_accuracy"' in metrics, f"{site} trained and logged its accuracy"
