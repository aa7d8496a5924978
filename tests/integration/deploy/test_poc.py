"""POC mode end to end: `flengine poc prepare / start / status / stop` as a user runs them, with
real daemon processes on 127.0.0.1, a job submitted through `flengine admin`, and pid files that
never let `stop` signal a process it did not start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.deploy.admin import AdminSession
from engine.deploy.pidfile import ProcessRecord, process_start, read_pid_file, write_pid_file
from engine.deploy.poc.prepare import free_port_block
from engine.provision import load_kit
from tests.integration.runtime.conftest import processes_mentioning
from tests.integration.runtime.jobkit import make_bench_job

FINAL = ("FINISHED_COMPLETED", "FINISHED_EXECUTION_EXCEPTION", "FINISHED_REJECTED", "FINISHED_ABORTED")


def flengine(*args: str, cwd: Path, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture
def poc(tmp_path: Path) -> Iterator[Path]:
    """A prepared POC folder on a free block of ports; whatever still runs of it at the end is killed (and fails the test)."""
    folder = tmp_path / "poc"
    prepared = flengine("poc", "prepare", "-d", str(folder), "--port", str(free_port_block(11)), cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    try:
        yield folder
    finally:
        flengine("poc", "stop", "-d", str(folder), cwd=tmp_path)
        leftovers = processes_mentioning(str(tmp_path))
        for line in leftovers:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
    assert leftovers == [], "processes outlived `flengine poc stop`"


def pids(folder: Path) -> dict[str, int]:
    return {path.stem: read_pid_file(path).pid for path in sorted((folder / "run").glob("*.pid"))}


def wait_final(admin_kit: Path, job_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    with AdminSession(load_kit(admin_kit)) as session:
        while time.monotonic() < deadline:
            record = session.command("status", job_id=job_id)
            if record["status"] in FINAL:
                return record
            time.sleep(0.3)
    raise AssertionError(f"job {job_id} still {record['status']} after {timeout_s:g} s")


@pytest.mark.slow  # end to end and long; CI runs it with -m slow, beside the doc's POC walk-through
def test_a_poc_starts_once_runs_a_submitted_job_and_stops_leaving_nothing(poc: Path, tmp_path: Path) -> None:
    job = make_bench_job(tmp_path / "jobs", num_rounds=1)

    started = flengine("poc", "start", "-d", str(poc), cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith(f"started server, site-1, site-2 in {poc}\n"), started.stdout
    assert f"submit a job:  flengine admin {poc / 'kits' / 'admin'} submit jobs/fedavg" in started.stdout
    first_pids = pids(poc)
    assert sorted(first_pids) == ["server", "site-1", "site-2"]

    again = flengine("poc", "start", "-d", str(poc), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"the POC in {poc} runs already; nothing started\n"), again.stdout
    assert pids(poc) == first_pids
    refused = flengine("poc", "prepare", "-d", str(poc), cwd=tmp_path)
    assert refused.returncode == 1
    assert f"Error: {poc}: the POC runs (server, site-1, site-2); stop it first: flengine poc stop -d {poc}" in (
        refused.stderr
    )

    status = flengine("poc", "status", "-d", str(poc), "--format", "json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["all_up"] is True
    assert [(d["name"], d["state"], d["pid"]) for d in report["daemons"]] == [
        (name, "running", first_pids[name]) for name in ("server", "site-1", "site-2")
    ]
    assert [d.get("connected") for d in report["daemons"]] == [None, True, True]

    submitted = flengine("admin", str(poc / "kits" / "admin"), "submit", str(job), cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    record = wait_final(poc / "kits" / "admin", submitted.stdout.split()[1])
    assert record["status"] == "FINISHED_COMPLETED", record
    assert sorted(record["sites"]) == ["site-1", "site-2"]

    stopped = flengine("poc", "stop", "-d", str(poc), cwd=tmp_path)

    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.splitlines() == [
        f"site-1  stopped (pid {first_pids['site-1']})",
        f"site-2  stopped (pid {first_pids['site-2']})",
        f"server  stopped (pid {first_pids['server']})",
        f"the POC in {poc} is stopped",
    ]
    assert processes_mentioning(str(poc)) == []
    assert list((poc / "run").iterdir()) == []
    assert "server of project poc stopped" in (poc / "workspaces" / "server" / "daemon.txt").read_text()
    idle = flengine("poc", "stop", "-d", str(poc), cwd=tmp_path)
    assert (idle.returncode, idle.stdout) == (0, f"nothing runs in {poc}\n")


def test_stop_never_signals_a_process_whose_pid_a_stale_pid_file_names(poc: Path, tmp_path: Path) -> None:
    # the pid of site-1's daemon, long gone, was handed to an unrelated process
    unrelated = subprocess.Popen(["sleep", "60"])
    try:
        write_pid_file(poc / "run" / "site-1.pid", ProcessRecord(unrelated.pid, "0:12345", "site-1", "site"))
        assert process_start(unrelated.pid) not in (None, "0:12345")

        status = flengine("poc", "status", "-d", str(poc), cwd=tmp_path)
        stopped = flengine("poc", "stop", "-d", str(poc), cwd=tmp_path)

        assert status.returncode == 1
        assert f"site-1  stale         {unrelated.pid}" in status.stdout
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.splitlines() == [
            f"site-1  stale pid file removed (pid {unrelated.pid} is no longer this daemon; nothing signalled)",
            f"nothing ran in {poc}",
        ]
        assert unrelated.poll() is None, "stop signalled a process it did not start"
        assert not (poc / "run" / "site-1.pid").exists()
    finally:
        unrelated.kill()
        unrelated.wait()
