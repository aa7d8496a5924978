"""Revoking a site of a running project by following docs/security.md word for word, then attacking
the server with the revoked site's kit from outside.

The project admin's folder holds ``docs/project.conf`` and ``kits/``; the server and the sites
run as separate processes from their owners' copies of their kits (``deployed/``). The doc's
commands run as a shell would run them, with ``/srv/flengine/server`` standing for the folder
the server runs its kit from. Both ways the doc gives (replace the folder, copy over) must
revoke: site-2 loses its connection and its running job process, cannot come back with its
old kit, and the scheduler carries on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.deploy.admin import AdminSession
from engine.provision import load_kit
from tests.integration.deploy.test_production import ROOT, Deployment
from tests.integration.runtime.conftest import processes_mentioning
from tests.integration.runtime.jobkit import make_bench_job

README_SERVER_KIT = "/srv/flengine/server"
#: Waits for a job that stays queued: site-1 declares no GPU.
NEVER_FITS = 'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = 1 } }'
REVOKED_WITHIN_S = 10.0


def bash_block_after(document: Path, heading: str) -> str:
    """The first bash block of ``document`` after ``heading``."""
    section = document.read_text(encoding="utf-8").split(heading, 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"{document}: no bash block after {heading!r}"
    return block.group(1)


def readme_revocation_steps() -> dict[str, list[str]]:
    """The revocation block of docs/security.md: the provision command, then each way's commands, by way.

    It is the one copy of these steps (docs/deploy.md links to it); the commands must be the ones run here.
    """
    block = bash_block_after(ROOT / "docs" / "security.md", "## Revoking a participant")
    steps: dict[str, list[str]] = {"provision": []}
    way = "provision"
    for line in block.splitlines():
        if line.startswith("# replace"):
            way = "replace"
        elif line.startswith("# or copy"):
            way = "copy-over"
        elif line.strip():
            steps.setdefault(way, []).append(line)
    assert len(steps["provision"]) == 1 and steps.keys() == {"provision", "replace", "copy-over"}, steps
    return steps


def run_as_written(command: str, deployment: Deployment) -> str:
    """Run one line of the doc in the project admin's folder; the server kit's folder stands for /srv/..."""
    line = command.replace(README_SERVER_KIT, str(deployment.deployed / "server"))
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-c", line], cwd=deployment.root, env=environment, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"{line}\n{done.stderr}"
    return done.stdout


def wait_until(condition, what: str, timeout_s: float = REVOKED_WITHIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.2)


def audit(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "audit.log").read_text(encoding="utf-8").splitlines()]


def log_of(folder: Path) -> str:
    return (folder / "log.txt").read_text(encoding="utf-8")


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    """A project of site-1 and site-2 whose daemons run from their owners' copies of their kits."""
    deployment = Deployment(tmp_path, project_file="docs/project.conf")
    deployment.send("server", "site-1", "site-2")
    try:
        yield deployment
    finally:
        deployment.close()
    leftovers = processes_mentioning(str(tmp_path))
    for entry in leftovers:
        os.kill(int(entry.split(":", 1)[0]), signal.SIGKILL)
    assert not leftovers, f"processes outlived their daemons: {leftovers}"


@pytest.mark.parametrize(
    ("way", "with_running_job"),
    [pytest.param("replace", False, marks=pytest.mark.slow), ("copy-over", True)],  # the second does more
    ids=["replace-the-folder", "copy-over-while-a-job-runs"],
)
def test_a_site_removed_as_the_readme_says_is_cut_off_and_cannot_come_back(
    deployment: Deployment, tmp_path: Path, way: str, with_running_job: bool
) -> None:
    steps = readme_revocation_steps()
    for name, role in (("server", "server"), ("site-1", "client"), ("site-2", "client")):
        deployment.start(name, role)
    with AdminSession(load_kit(deployment.kits / "alice")) as alice:  # polls without a process each
        wait_until(lambda: len([e for e in alice.command("clients") if e["connected"]]) == 2, "both sites", 30.0)
        queued = make_bench_job(tmp_path / "queued", num_rounds=1)
        (queued / "meta.conf").write_text(f"name = queued\n{NEVER_FITS}\n", encoding="utf-8")
        waiting = alice.submit(queued)["job_id"]  # stays queued: the scheduler looks at it every second
        running = site_2_job = ""
        if with_running_job:  # site-2's script sleeps: its job process runs until it is told to stop
            slow = make_bench_job(
                tmp_path / "slow", num_rounds=2, script_args="--fault sleep --fault-site site-2 --sleep-s 120"
            )
            running = alice.submit(slow)["job_id"]
            wait_until(lambda: alice.command("status", job_id=running)["status"] == "RUNNING", "the job runs", 60.0)
            site_2_job = f"--site site-2 --job-id {running}"
            wait_until(lambda: processes_mentioning(site_2_job), "site-2's job process")

        deployment.write_project(("site-1",))  # "delete its line"
        printed = run_as_written(steps["provision"][0], deployment)
        for command in steps[way]:
            run_as_written(command, deployment)

        printed = printed.replace(str(deployment.deployed / "server"), README_SERVER_KIT)
        assert (
            printed.split(f"# roll the server kit out to {README_SERVER_KIT}", 1)[1].splitlines()[1:]
            == steps["replace"]
        )
        wait_until(lambda: [e["site"] for e in alice.command("clients")] == ["site-1"], "site-2 off the list")
        server_workspace, site_2_workspace = tmp_path / "server-workspace", tmp_path / "site-2-workspace"
        wait_until(lambda: "no longer on the allowlist" in log_of(site_2_workspace), "site-2 told it was revoked")
        events = audit(server_workspace)
        assert [(e["outcome"], e.get("removed")) for e in events if e["action"] == "reload"] == [("ok", ["site-2"])]
        ignored = [e["files"] for e in events if e["action"] == "kit_files_ignored"]
        assert ignored == ([["keys/allowlist/site-2.key"]] if way == "copy-over" else [])
        if with_running_job:
            wait_until(lambda: not processes_mentioning(site_2_job), "site-2's job process stopped")
            assert [(e["job"], e["site"]) for e in events if e["action"] == "job_site_revoked"] == [(running, "site-2")]
            # the site's daemon records the job's end once it has reaped the process: a moment later
            wait_until(
                lambda: [e for e in audit(site_2_workspace) if e["action"] == "job_end" and e["job"] == running],
                "site-2's audit records the job's end",
            )

            # the job's own server process refuses site-2 from now on, and goes on without it
            def deaths() -> list[tuple[str, str]]:
                found = []
                for events_file in (server_workspace / "jobs" / running / "workspace").glob("*/events.jsonl"):
                    lines = [json.loads(line) for line in events_file.read_text().splitlines() if "client_dead" in line]
                    found += [(e["site"], e["reason"]) for e in lines]
                return found

            wait_until(lambda: deaths(), "the job's server process leaves site-2 out")
            assert deaths() == [("site-2", "revoked: its key left the server's allowlist")]

        # site-2 comes back with its old kit (which still verifies): refused at the handshake
        deployment.stop("site-2")
        deployment.start("site-2", "client")
        wait_until(lambda: "refused this cell's key" in log_of(site_2_workspace), "site-2's new connection refused")
        assert [e["site"] for e in alice.command("clients")] == ["site-1"]
        assert alice.command("status", job_id=waiting)["status"] == "SUBMITTED"
        assert "scheduler error" not in log_of(server_workspace)
