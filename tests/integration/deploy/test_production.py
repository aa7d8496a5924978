"""Production mode end to end: a provisioned project, the server and two site daemons as separate
long-running processes (each with only its own kit and workspace), jobs submitted, watched,
aborted and downloaded through `flengine admin`, exactly as an operator would."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.deploy.poc.prepare import free_port_block
from engine.examples.digits import Net, load_split
from engine.provision import load_project, provision
from tests.integration.deploy.summary_checks import assert_downloaded_summary
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

ROOT = Path(__file__).resolve().parents[3]
SITES = ("site-1", "site-2")


class Deployment:
    """The kits of a provisioned project and the daemons started from them (stopped at the end).

    The project admin's folder is ``root``: the project file (``project_file``) and ``kits/``.
    A daemon runs from its kit there, or from its owner's copy in ``deployed/`` once `send`
    made one (so that re-provisioning does not touch the kit a daemon runs).
    """

    def __init__(self, root: Path, project_file: str = "project.conf") -> None:
        self.root = root
        self.port = free_port_block(11)
        self.kits = root / "kits"
        self.deployed = root / "deployed"
        self.project = root / project_file
        self.provision(SITES)
        self.daemons: dict[str, subprocess.Popen[str]] = {}

    def write_project(self, sites: tuple[str, ...]) -> None:
        """Write the project file: ``sites`` at one hospital each, admins alice and carol."""
        listed = ", ".join(f"{{ name = {site}, org = hospital-{site[-1]} }}" for site in sites)
        self.project.parent.mkdir(parents=True, exist_ok=True)
        self.project.write_text(
            "name = e2e\n"
            f"server {{ host = 127.0.0.1, port = {self.port}, org = lab }}\n"
            f"sites = [ {listed} ]\n"
            "admins = [ { name = alice, org = lab, role = project_admin },\n"
            "           { name = carol, org = hospital-2, role = member } ]\n"
        )

    def provision(self, sites: tuple[str, ...], remove: bool = False) -> None:
        """Write (or update) the kits of `write_project`'s project."""
        self.write_project(sites)
        provision(load_project(self.project), self.kits, remove=remove)

    def send(self, *names: str) -> None:
        """Copy kits to ``deployed/NAME``, as a project admin sends them to their owners."""
        for name in names:
            shutil.copytree(self.kits / name, self.deployed / name)  # modes kept: 0700 folders, 0600 secret

    def kit(self, name: str) -> Path:
        """The kit a daemon of ``name`` runs: its owner's copy if sent, else the project admin's."""
        return self.deployed / name if (self.deployed / name).is_dir() else self.kits / name

    def start(self, name: str, role: str) -> subprocess.Popen[str]:
        workspace = self.root / f"{name}-workspace"
        process = subprocess.Popen(
            [sys.executable, "-m", "engine", role, "start", str(self.kit(name)), "--workspace", str(workspace)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = process.stdout.readline()
        assert "started" in line, f"{name} did not start: {line}{process.stderr.read() if process.poll() else ''}"
        self.daemons[name] = process
        return process

    def admin(self, who: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "engine", "admin", str(self.kits / who), *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=180,
        )

    def admin_json(self, who: str, *args: str):
        done = self.admin(who, *args, "--format", "json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def wait_status(self, job_id: str, *final: str, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        record = {}
        while time.monotonic() < deadline:
            record = self.admin_json("alice", "status", job_id)
            if record["status"] in final:
                return record
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {record.get('status')}: {record}")

    def wait_connected(self, *sites: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            answer = self.admin_json("alice", "clients")
            if all(entry["connected"] for entry in answer if entry["site"] in sites):
                return
            time.sleep(0.5)
        raise AssertionError(f"sites not connected: {answer}")

    def stop(self, name: str) -> int:
        process = self.daemons.pop(name)
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(5)

    def close(self) -> None:
        for name in list(self.daemons):
            self.stop(name)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path)
    try:
        yield deployment
    finally:
        deployment.close()
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    for pid in leftovers:
        os.kill(int(pid), signal.SIGKILL)
    assert not leftovers, "job processes outlived their daemons"


def bench_initial(job: Path) -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(job / "app" / "custom"))
    try:
        from benchnet_model import BenchNet

        return {name: t.detach().clone() for name, t in BenchNet(layers=2, width=32).state_dict().items()}
    finally:
        sys.path.remove(str(job / "app" / "custom"))


def test_a_job_submitted_to_a_deployed_project_runs_on_both_sites_and_downloads(
    deployment: Deployment, tmp_path: Path
) -> None:
    job = make_bench_job(tmp_path / "jobs", num_rounds=2)
    deployment.start("server", "server")
    for site in SITES:
        deployment.start(site, "client")
    deployment.wait_connected(*SITES)
    with socket.socket() as other_program:  # holds the first job port: the job takes the next one
        other_program.bind(("127.0.0.1", deployment.port + 1))
        other_program.listen()

        submitted = deployment.admin("alice", "submit", str(job))
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.split()[1]
        record = deployment.wait_status(
            job_id, "FINISHED_COMPLETED", "FINISHED_EXECUTION_EXCEPTION", "FINISHED_REJECTED"
        )

    assert record["status"] == "FINISHED_COMPLETED", record
    assert record["port"] == deployment.port + 2
    assert sorted(record["sites"]) == list(SITES)
    downloaded = deployment.admin("alice", "download", job_id, "-o", str(tmp_path / "results"))
    assert downloaded.returncode == 0, downloaded.stderr
    assert_downloaded_summary(tmp_path / "results" / job_id, job_id, SITES)  # the report reads it
    final = load_file(tmp_path / "results" / job_id / "server" / "models" / "global.safetensors")
    for name, tensor in bench_initial(job).items():
        expected = tensor.double() + 2 * expected_delta(2)
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name
    for site in SITES:  # every site handed in its results before the job counted as finished
        process = json.loads((tmp_path / "results" / job_id / site / "process.json").read_text())
        assert process["tasks_done"] == 2
    logs = deployment.admin_json("alice", "logs", job_id, "site-2")
    assert logs["site"] == "site-2" and any("task" in line for line in logs["lines"])
    assert "FINISHED_COMPLETED" in deployment.admin("alice", "list").stdout
    # a member of another org does not even learn that the job exists; the audit log has it all
    refused = deployment.admin("carol", "download", job_id)
    assert refused.returncode == 1 and refused.stderr == f"Error: no job {job_id}\n"
    audit = (tmp_path / "server-workspace" / "audit.log").read_text().splitlines()
    actions = [(entry["actor"], entry["action"], entry["outcome"]) for entry in map(json.loads, audit)]
    assert ("alice", "submit", "ok") in actions and ("carol", "download", "refused") in actions
    assert ("server", "job_end", "FINISHED_COMPLETED") in actions
    site_audit = [json.loads(line) for line in (tmp_path / "site-1-workspace" / "audit.log").read_text().splitlines()]
    assert [e["action"] for e in site_audit if e.get("job") == job_id][:2] == ["job_deploy", "job_start"]


@pytest.mark.slow  # end to end and long; CI runs it with -m slow
def test_abort_ends_every_job_process_and_the_server_keeps_its_jobs_over_a_restart(
    deployment: Deployment, tmp_path: Path
) -> None:
    slow = make_bench_job(
        tmp_path / "slow", num_rounds=3, script_args="--fault sleep --fault-site site-1 --sleep-s 120"
    )
    deployment.start("server", "server")
    for site in SITES:
        deployment.start(site, "client")
    deployment.wait_connected(*SITES)
    job_id = deployment.admin_json("alice", "submit", str(slow))["job_id"]
    deployment.wait_status(job_id, "RUNNING")

    aborted = deployment.admin_json("alice", "abort", job_id)

    assert aborted["status"] == "FINISHED_ABORTED" and "aborted by alice" in aborted["reason"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and subprocess.run(["pgrep", "-f", job_id], capture_output=True).stdout:
        time.sleep(0.2)
    assert not subprocess.run(["pgrep", "-f", job_id], capture_output=True).stdout, "a job process outlived abort"
    assert deployment.stop("server") == 0
    deployment.start("server", "server")
    listed = deployment.admin_json("alice", "list")
    assert [(job["job_id"], job["status"]) for job in listed] == [(job_id, "FINISHED_ABORTED")]
    downloaded = deployment.admin("alice", "download", job_id, "-o", str(tmp_path / "after-restart"))
    assert downloaded.returncode == 0, downloaded.stderr
    assert (tmp_path / "after-restart" / job_id / "server" / "log.txt").is_file()


@pytest.mark.slow  # end to end; CI runs it with -m slow
def test_a_reprovisioned_server_kit_is_picked_up_without_a_restart(deployment: Deployment, tmp_path: Path) -> None:
    deployment.start("server", "server")
    deployment.start("site-1", "client")
    deployment.wait_connected("site-1")

    deployment.provision(("site-1", "site-2", "site-3"))  # in place: the running server's kit changes
    deployment.start("site-3", "client")
    deployment.wait_connected("site-3")
    deployment.provision(("site-2", "site-3"), remove=True)  # site-1 revoked while connected
    deadline = time.monotonic() + 20
    clients = []
    while time.monotonic() < deadline:
        clients = [entry["site"] for entry in deployment.admin_json("alice", "clients")]
        if "site-1" not in clients:
            break
        time.sleep(0.5)

    assert clients == ["site-2", "site-3"]
    audit = [json.loads(line) for line in (tmp_path / "server-workspace" / "audit.log").read_text().splitlines()]
    reloads = [(entry["added"], entry["removed"]) for entry in audit if entry["action"] == "reload"]
    assert reloads == [(["site-3"], []), ([], ["site-1"])]
    deadline = time.monotonic() + 10
    log = ""
    while time.monotonic() < deadline and "no longer on the allowlist" not in log:
        time.sleep(0.5)
        log = (tmp_path / "server-workspace" / "log.txt").read_text()
    assert "the key of 'site-1' is no longer on the allowlist" in log


@pytest.mark.slow  # the simulator's test of jobs/fedavg covers the training; this one the same job deployed
def test_jobs_fedavg_trains_the_digits_model_to_90_percent_in_production_mode(
    deployment: Deployment, tmp_path: Path
) -> None:
    deployment.start("server", "server")
    for site in SITES:
        deployment.start(site, "client")
    deployment.wait_connected(*SITES)

    job_id = deployment.admin_json("alice", "submit", str(ROOT / "jobs" / "fedavg"))["job_id"]
    record = deployment.wait_status(job_id, "FINISHED_COMPLETED", "FINISHED_EXECUTION_EXCEPTION", timeout_s=300)

    assert record["status"] == "FINISHED_COMPLETED", record
    assert deployment.admin("alice", "download", job_id, "-o", str(tmp_path / "results")).returncode == 0
    weights = load_file(tmp_path / "results" / job_id / "server" / "models" / "global.safetensors")
    _, (val_x, val_y) = load_split(0, 2)
    net = Net(hidden=64)
    net.load_state_dict(weights)
    accuracy = (net(val_x).argmax(dim=1) == val_y).float().mean().item()
    assert accuracy >= 0.90
    metrics = [json.loads(line) for line in (tmp_path / "results" / job_id / "site-1" / "metrics.jsonl").open()]
    assert metrics, "site-1 handed in its metrics"
