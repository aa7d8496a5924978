"""Production mode: the server host goes down mid-job (its daemon and the job's server process
SIGKILLed) and the server is started again: the job resumes, same id, on the same sites, from its
last completed round, and ends at the model of a run that never stopped. A site's job process
that crashes is started again by its daemon and takes part again."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.faults.conftest import events_of, first_after
from tests.integration.deploy.test_production import SITES, Deployment, bench_initial, deployment  # noqa: F401
from tests.integration.runtime.jobkit import expected_delta, make_bench_job, pids_of

ROUNDS = 5


def _wait_checkpoint(root: Path, job_id: str, next_round: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for record in root.glob(f"server-workspace/jobs/{job_id}/workspace/*/checkpoint/fedavg/state.json"):
            try:
                if json.loads(record.read_text())["next_round"] == next_round:
                    return
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(0.05)
    raise AssertionError(f"round {next_round + 1} of {job_id} never began")


def _started(deployment: Deployment, tmp_path: Path, **job_args: object) -> tuple[Path, str]:  # noqa: F811
    """Start the project's daemons and submit a BenchNet job; return the job folder and its id."""
    job = make_bench_job(tmp_path / "jobs", **job_args)  # type: ignore[arg-type]
    deployment.start("server", "server")
    for site in SITES:
        deployment.start(site, "client")
    deployment.wait_connected(*SITES)
    return job, deployment.admin_json("alice", "submit", str(job))["job_id"]


def _assert_exact(deployment: Deployment, tmp_path: Path, job: Path, job_id: str) -> None:  # noqa: F811
    """The job's downloaded global model is the analytic one of ROUNDS rounds of both sites."""
    downloaded = deployment.admin("alice", "download", job_id, "-o", str(tmp_path / "results"))
    assert downloaded.returncode == 0, downloaded.stderr
    final = load_file(tmp_path / "results" / job_id / "server" / "models" / "global.safetensors")
    for name, tensor in bench_initial(job).items():
        expected = tensor.double() + ROUNDS * expected_delta(2)
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name


SLOW_ROUND_3 = "--fault sleep --fault-site site-1 --fault-round 2 --sleep-s 3"


@pytest.mark.slow  # end to end and long; CI runs it with -m slow
def test_a_job_resumes_after_the_server_host_went_down(
    deployment: Deployment,  # noqa: F811
    tmp_path: Path,
    fault_figures,
) -> None:
    job, job_id = _started(deployment, tmp_path, num_rounds=ROUNDS, script_args=SLOW_ROUND_3)
    _wait_checkpoint(tmp_path, job_id, 2)  # round 3 runs: site-1 takes 3 s over it

    daemon = deployment.daemons.pop("server")
    for pid in [daemon.pid, *pids_of("entry server", job_id)]:
        os.kill(pid, signal.SIGKILL)  # the host is gone: the daemon and the job's server process at once
    daemon.wait(10)
    restarted_at = time.time()
    deployment.start("server", "server")

    record = deployment.wait_status(job_id, "FINISHED_COMPLETED", "FINISHED_ABORTED", "FINISHED_EXECUTION_EXCEPTION")
    assert record["status"] == "FINISHED_COMPLETED", record
    assert record["resumes"] == 1 and sorted(record["sites"]) == list(SITES)
    _assert_exact(deployment, tmp_path, job, job_id)
    audit = [json.loads(line) for line in (tmp_path / "server-workspace" / "audit.log").read_text().splitlines()]
    assert ("job_resume", "queued") in [(e["action"], e["outcome"]) for e in audit if e.get("job") == job_id]
    site_audit = [json.loads(line) for line in (tmp_path / "site-1-workspace" / "audit.log").read_text().splitlines()]
    assert "job_resume" in [e["action"] for e in site_audit if e.get("job") == job_id]
    events = events_of(tmp_path / "results" / job_id / "server" / "events.jsonl")
    fault_figures.record(
        "production: the server host down mid-round (daemon and job process SIGKILLed), daemon started again",
        "the job is queued again, same id; its sites start their job processes again; it resumes from its last "
        "completed round; FINISHED_COMPLETED",
        recover_s=first_after(events, "round_done", restarted_at)["at"] - restarted_at,
        rounds_lost=1,
        exact=True,
    )


@pytest.mark.slow
def test_a_crashed_site_job_process_is_started_again_and_the_job_completes(
    deployment: Deployment,  # noqa: F811
    tmp_path: Path,
    fault_figures,
) -> None:
    _, job_id = _started(
        deployment,
        tmp_path,
        num_rounds=4,
        workflow_args={"site_wait_timeout": 60.0},
        script_args="--fault kill --fault-site site-2 --fault-round 1",
    )

    record = deployment.wait_status(job_id, "FINISHED_COMPLETED", "FINISHED_ABORTED", "FINISHED_EXECUTION_EXCEPTION")

    assert record["status"] == "FINISHED_COMPLETED", record
    site_audit = [json.loads(line) for line in (tmp_path / "site-2-workspace" / "audit.log").read_text().splitlines()]
    assert [e["restart"] for e in site_audit if e["action"] == "job_restart"] == [1]
    server_audit = [json.loads(line) for line in (tmp_path / "server-workspace" / "audit.log").read_text().splitlines()]
    assert ("site-2", "job_process_crash") in [(e["actor"], e["action"]) for e in server_audit]
    downloaded = deployment.admin("alice", "download", job_id, "-o", str(tmp_path / "results"))
    assert downloaded.returncode == 0, downloaded.stderr
    summary_events = (tmp_path / "results" / job_id / "server" / "events.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["event"] for line in summary_events]
    assert "client_dead" in kinds and "client_back" in kinds  # left out at once, back from the next round
    events = [json.loads(line) for line in summary_events]
    dead = first_after(events, "client_dead", 0)
    fault_figures.record(
        "production: a site's job process SIGKILLed mid-round",
        "its daemon tells the server (the site is dead at once) and starts the process again; back at its "
        "first task request; FINISHED_COMPLETED",
        recover_s=first_after(events, "client_back", dead["at"])["at"] - dead["at"],
        rounds_lost=0,
    )


@pytest.mark.slow
def test_a_crashed_server_job_process_resumes_by_itself(
    deployment: Deployment,  # noqa: F811
    tmp_path: Path,
    fault_figures,
) -> None:
    job, job_id = _started(deployment, tmp_path, num_rounds=ROUNDS, script_args=SLOW_ROUND_3)
    _wait_checkpoint(tmp_path, job_id, 2)

    (server,) = pids_of("entry server", job_id)
    crashed_at = time.time()
    os.kill(server, signal.SIGKILL)  # the job's server process alone: the daemon sees it end

    record = deployment.wait_status(job_id, "FINISHED_COMPLETED", "FINISHED_ABORTED", "FINISHED_EXECUTION_EXCEPTION")
    assert record["status"] == "FINISHED_COMPLETED", record
    assert record["resumes"] == 1
    _assert_exact(deployment, tmp_path, job, job_id)
    events = events_of(tmp_path / "results" / job_id / "server" / "events.jsonl")
    fault_figures.record(
        "production: the job's server process SIGKILLed mid-round (its daemon lives)",
        "the daemon queues the job to resume at once; its sites start again; FINISHED_COMPLETED",
        recover_s=first_after(events, "round_done", crashed_at)["at"] - crashed_at,
        rounds_lost=1,
        exact=True,
    )


@pytest.mark.slow
def test_a_server_stopped_and_started_again_resumes_its_running_job(
    deployment: Deployment,  # noqa: F811
    tmp_path: Path,
) -> None:
    job, job_id = _started(deployment, tmp_path, num_rounds=ROUNDS, script_args=SLOW_ROUND_3)
    _wait_checkpoint(tmp_path, job_id, 2)

    assert deployment.stop("server") == 0  # SIGTERM: an orderly stop, e.g. for an upgrade
    deployment.start("server", "server")

    record = deployment.wait_status(job_id, "FINISHED_COMPLETED", "FINISHED_ABORTED", "FINISHED_EXECUTION_EXCEPTION")
    assert record["status"] == "FINISHED_COMPLETED", record
    assert record["resumes"] == 1
    audit = [json.loads(line) for line in (tmp_path / "server-workspace" / "audit.log").read_text().splitlines()]
    assert ("job_stopped", "resumes_at_start") in [(e["action"], e["outcome"]) for e in audit if e.get("job") == job_id]
