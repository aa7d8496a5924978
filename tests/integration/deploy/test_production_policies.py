"""Production mode under load, policies and faults, on one deployed project shared by the module.

The project (provisioned by the `Deployment` helper of ``test_production``, then provisioned again
with a third site and more admins) runs as real processes: the server and three site daemons,
each with only its own kit and workspace. ``site-3``'s own ``policy.conf`` refuses custom code.
Jobs name their sites (``site-1``, ``site-2``) so that ``site-3`` takes part only where a test
says so. Commands whose exit code and printed reason matter go through ``flengine admin``; the
rest go through an in-process `AdminSession`, which is faster than starting a process per poll.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.deploy import protocol
from engine.deploy.admin import AdminError, AdminSession
from engine.deploy.archive import archive_digest
from engine.provision import load_kit, load_project, provision
from tests.integration.deploy.test_production import ROOT, Deployment, bench_initial
from tests.integration.runtime.conftest import processes_mentioning
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

SITES = ("site-1", "site-2", "site-3")
#: The project of the `Deployment` helper (same server, port and keys), with site-3 and more admins.
PROJECT = """\
name = e2e
server {{ host = 127.0.0.1, port = {port}, org = lab }}
sites = [ {{ name = site-1, org = hospital-a }}, {{ name = site-2, org = hospital-b }},
          {{ name = site-3, org = hospital-c }} ]
admins = [ {{ name = alice, org = lab, role = project_admin }},
           {{ name = carol, org = hospital-b, role = member }},
           {{ name = bob, org = hospital-a, role = lead }},
           {{ name = dave, org = hospital-a, role = lead }} ]
"""
ON_SITES_1_AND_2 = 'min_clients = 2\ndeploy_map { app = ["server", "site-1", "site-2"] }'
#: A job that waits in the queue for good: site-1 declares no GPU.
NEVER_FITS = 'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = 1 } }'
FINAL_TIMEOUT_S = 90.0
POLL_S = 0.3


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The server and three site daemons, running for the whole module; nothing may outlive them."""
    root = tmp_path_factory.mktemp("policies")
    deployment = Deployment(root)
    (root / "project.conf").write_text(PROJECT.format(port=deployment.port), encoding="utf-8")
    provision(load_project(root / "project.conf"), deployment.kits)
    policy = deployment.kits / "site-3" / "policy.conf"
    text = policy.read_text(encoding="utf-8")
    assert "allow_custom_code = true" in text
    policy.write_text(text.replace("allow_custom_code = true", "allow_custom_code = false"), encoding="utf-8")
    try:
        deployment.start("server", "server")
        for site in SITES:
            deployment.start(site, "client")
        yield deployment
    finally:
        deployment.close()
        leftovers = processes_mentioning(str(root))
        for line in leftovers:
            subprocess.run(["kill", "-9", line.split(":", 1)[0]], check=False)
    assert leftovers == [], "processes outlived their daemons"


@pytest.fixture(scope="module")
def alice(deployment: Deployment) -> Iterator[AdminSession]:
    """The project admin's session, open once every site has been heard from."""
    with AdminSession(load_kit(deployment.kits / "alice")) as session:
        wait_heard_from(session, *SITES)
        yield session


def wait_heard_from(session: AdminSession, *sites: str, since: float | None = None) -> None:
    """Wait until ``admin clients`` shows ``sites`` connected (with a status sent after ``since``)."""
    deadline = time.monotonic() + 30.0
    answer: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        answer = session.command("clients")
        fresh = {
            entry["site"]
            for entry in answer
            if entry["connected"] and (since is None or entry["last_status_s"] < time.monotonic() - since)
        }
        if fresh >= set(sites):
            return
        time.sleep(POLL_S)
    raise AssertionError(f"not heard from {sites}: {answer}")


def wait_final(session: AdminSession, job_id: str, timeout_s: float = FINAL_TIMEOUT_S) -> dict[str, Any]:
    """The job's record once it has ended."""
    deadline = time.monotonic() + timeout_s
    record: dict[str, Any] = {}
    while time.monotonic() < deadline:
        record = session.command("status", job_id=job_id)
        if record["status"].startswith("FINISHED"):
            return record
        time.sleep(POLL_S)
    raise AssertionError(f"job {job_id} did not end within {timeout_s:g} s: {record}")


def bench_job(root: Path, meta: str) -> Path:
    """The one-round BenchNet job under ``root`` with ``meta`` as its ``meta.conf``."""
    job = make_bench_job(root, num_rounds=1)
    (job / "meta.conf").write_text(f"name = bench\n{meta}\n", encoding="utf-8")
    return job


def assert_exact_model(session: AdminSession, job_id: str, job: Path, dest: Path) -> None:
    """The downloaded global model is the initial one plus one round of the BENCHMARK.md update."""
    folder = session.download(job_id, dest)
    final = load_file(folder / "server" / "models" / "global.safetensors")
    for name, tensor in bench_initial(job).items():
        expected = tensor.double() + expected_delta(2)
        assert torch.allclose(final[name].double(), expected, rtol=0, atol=1e-6), name


def audit(deployment: Deployment, who: str) -> list[dict[str, Any]]:
    path = deployment.root / f"{who}-workspace" / "audit.log"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def job_events(deployment: Deployment, who: str, job_id: str) -> list[tuple[str, str, str]]:
    """(actor, action, outcome) of the audit lines about ``job_id``, leaving out ``status`` reads."""
    return [
        (e["actor"], e["action"], e["outcome"])
        for e in audit(deployment, who)
        if e.get("job") == job_id and e["action"] != "status"
    ]


def assert_no_job_process(job_id: str, timeout_s: float = 20.0) -> None:
    """No process mentions ``job_id`` (job processes are stopped asynchronously: give them a moment)."""
    deadline = time.monotonic() + timeout_s
    while processes_mentioning(job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(job_id) == []


# ----------------------------------------------------------------- scheduling


def test_two_jobs_submitted_at_once_both_complete_with_exact_models(
    deployment: Deployment, alice: AdminSession, tmp_path: Path
) -> None:
    jobs = [bench_job(tmp_path / f"job-{n}", ON_SITES_1_AND_2) for n in (1, 2)]

    ids = [alice.submit(job)["job_id"] for job in jobs]
    records = [wait_final(alice, job_id) for job_id in ids]

    assert [r["status"] for r in records] == ["FINISHED_COMPLETED"] * 2, records
    assert [r["sites"] for r in records] == [["site-1", "site-2"]] * 2
    assert records[0]["port"] != records[1]["port"], "each job gets a job port of its own"
    for job, job_id in zip(jobs, ids, strict=True):
        assert_exact_model(alice, job_id, job, tmp_path / "results")
        assert_no_job_process(job_id)


def test_a_job_whose_resource_spec_is_not_a_number_is_refused_not_queued_for_ever(
    alice: AdminSession, tmp_path: Path
) -> None:
    job = bench_job(
        tmp_path,
        'min_clients = 1\ndeploy_map { app = ["server", "site-1"] }\nresource_spec { site-1 { num_gpus = two } }',
    )
    try:
        job_id = alice.submit(job)["job_id"]
    except AdminError as e:  # refused at submission: as good
        assert "resource_spec" in str(e)
        return
    try:
        record = wait_final(alice, job_id, timeout_s=4.0)  # a few scheduler passes
    finally:
        if alice.command("status", job_id=job_id)["status"] == "SUBMITTED":
            alice.command("abort", job_id=job_id)
    assert record["status"] == "FINISHED_REJECTED" and "resource_spec" in record["reason"]


# ----------------------------------------------------------------- site policy


def test_a_site_whose_policy_refuses_custom_code_refuses_the_job_with_the_reason(
    deployment: Deployment, alice: AdminSession, tmp_path: Path
) -> None:
    job = bench_job(tmp_path, 'min_clients = 1\ndeploy_map { app = ["server", "site-3"] }')

    job_id = alice.submit(job)["job_id"]
    record = wait_final(alice, job_id)

    assert record["status"] == "FINISHED_REJECTED"
    assert record["reason"] == (
        "refused by sites: site-3: this site runs no job that brings its own code "
        "(its policy's allow_custom_code = false)"
    )
    assert record["started_at"] is None
    assert job_events(deployment, "server", job_id) == [
        ("alice", "submit", "ok"),
        ("site-3", "job_deploy", "refused"),
        ("server", "job_end", "FINISHED_REJECTED"),
    ]
    assert job_events(deployment, "site-3", job_id) == [("site-3", "job_deploy", "refused")]
    assert not (deployment.root / "site-3-workspace" / job_id).exists()
    server_side = deployment.root / "server-workspace" / "jobs" / job_id / "workspace"
    assert list(server_side.iterdir()) == [], "the server started a job process"
    assert_no_job_process(job_id)


def test_a_job_refused_by_one_site_starts_no_job_process_on_the_others(
    deployment: Deployment, alice: AdminSession, tmp_path: Path
) -> None:
    job = bench_job(tmp_path, 'min_clients = 2\ndeploy_map { app = ["server", "site-1", "site-3"] }')

    job_id = alice.submit(job)["job_id"]
    record = wait_final(alice, job_id)
    assert_no_job_process(job_id)

    assert record["status"] == "FINISHED_REJECTED" and "site-3: this site runs no job" in record["reason"]
    assert ("site-1", "job_start", "ok") not in job_events(deployment, "site-1", job_id)


# ----------------------------------------------------------------- kits


@pytest.mark.parametrize("file", ["start.sh", "kit.json"])
def test_a_tampered_kit_is_refused_at_start(deployment: Deployment, tmp_path: Path, file: str) -> None:
    kit = tmp_path / "site-1"
    shutil.copytree(deployment.kits / "site-1", kit)
    tampered = kit / file
    data = bytearray(tampered.read_bytes())
    data[len(data) // 2] ^= 0x01
    tampered.write_bytes(bytes(data))
    workspace = tmp_path / "workspace"

    done = subprocess.run(
        [sys.executable, "-m", "engine", "client", "start", str(kit), "--workspace", str(workspace)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode != 0
    assert done.stderr.startswith("Error: ") and "Traceback" not in done.stderr, done.stderr
    assert f"{tampered}: changed since the kit was provisioned" in done.stderr
    assert "started" not in done.stdout
    assert not workspace.exists()
    assert processes_mentioning(str(kit)) == []


# ----------------------------------------------------------------- restarts


def test_a_client_restarted_while_idle_rejoins_and_runs_the_next_job(
    deployment: Deployment, alice: AdminSession, tmp_path: Path
) -> None:
    assert deployment.stop("site-2") == 0
    restarted = time.monotonic()
    deployment.start("site-2", "client")
    wait_heard_from(alice, "site-2", since=restarted)
    job = bench_job(tmp_path, ON_SITES_1_AND_2)

    job_id = alice.submit(job)["job_id"]
    record = wait_final(alice, job_id)

    assert record["status"] == "FINISHED_COMPLETED", record
    assert_exact_model(alice, job_id, job, tmp_path / "results")
    starts = [e for e in audit(deployment, "site-2") if e["action"] == "start"]
    assert len(starts) == 2
    assert ("site-2", "job_start", "ok") in job_events(deployment, "site-2", job_id)


# ----------------------------------------------------------------- authorization


def test_only_the_submitting_lead_may_abort_their_job(
    deployment: Deployment, alice: AdminSession, tmp_path: Path
) -> None:
    with AdminSession(load_kit(deployment.kits / "bob")) as bob:
        job_id = bob.submit(bench_job(tmp_path, NEVER_FITS))["job_id"]

    member = deployment.admin("carol", "abort", job_id)
    other_lead = deployment.admin("dave", "abort", job_id)
    still = alice.command("status", job_id=job_id)
    own = deployment.admin_json("bob", "abort", job_id)

    # carol (hospital-b) may not see a job of hospital-a: she reads what an unknown id reads
    assert (member.returncode, member.stderr) == (1, f"Error: no job {job_id}\n")
    assert (other_lead.returncode, other_lead.stderr) == (
        1,
        "Error: lead dave may abort their own jobs only; "
        "a lead submits jobs, their own code included, manages their own and sees those of their organisation\n",
    )
    assert still["status"] == "SUBMITTED"
    assert own["status"] == "FINISHED_ABORTED" and own["reason"] == "aborted by bob: abort command"
    assert job_events(deployment, "server", job_id) == [
        ("bob", "submit", "ok"),
        ("carol", "abort", "refused"),
        ("dave", "abort", "refused"),
        ("server", "job_end", "FINISHED_ABORTED"),
        ("bob", "abort", "ok"),
    ]


# ----------------------------------------------------------------- hostile archives


def _dotdot(zf: zipfile.ZipFile) -> None:
    zf.writestr("../evil.py", "raise SystemExit('escaped')\n")


def _dotdot_inside(zf: zipfile.ZipFile) -> None:
    zf.writestr("app/custom/../../../evil.py", "raise SystemExit('escaped')\n")


def _symlink(zf: zipfile.ZipFile) -> None:
    info = zipfile.ZipInfo("app/custom/evil.py")
    info.create_system = 3  # unix, so that the mode bits count
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    zf.writestr(info, "/etc/passwd")


HOSTILE = {
    "dotdot": (_dotdot, "member '../evil.py': a '..' part would leave the job folder"),
    "dotdot-inside": (_dotdot_inside, "member 'app/custom/../../../evil.py': a '..' part would leave the job folder"),
    "symlink": (_symlink, "member 'app/custom/evil.py': is a symbolic link (job archives may not hold links)"),
}


def craft_archive(job: Path, dest: Path, add: Callable[[zipfile.ZipFile], None]) -> Path:
    """A zip of ``job``'s files plus what ``add`` writes, made without `pack_job` and its checks."""
    dest.parent.mkdir(parents=True)
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(job.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(job).as_posix())
        add(zf)
    return dest


def send_archive(session: AdminSession, archive: Path) -> Any:
    """Offer ``archive`` to the server and submit it, as `AdminSession.submit` does after packing."""
    size, digest = archive.stat().st_size, archive_digest(archive)
    ref = session.endpoint.service.add_file(
        archive, protocol.ARCHIVE_CHUNK_BYTES, [session.kit.server.name], 60.0, owned_folder=archive.parent
    )
    return session.command("submit", ref=ref, size=size, digest=digest)


@pytest.mark.parametrize("add, reason", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_job_archive_is_refused_naming_the_member_and_the_server_keeps_serving(
    deployment: Deployment,
    alice: AdminSession,
    tmp_path: Path,
    add: Callable[[zipfile.ZipFile], None],
    reason: str,
) -> None:
    job = bench_job(tmp_path / "jobs", NEVER_FITS)
    archive = craft_archive(job, tmp_path / "offer" / "job.zip", add)
    jobs_before = alice.command("list")

    with pytest.raises(AdminError, match=re.escape(f"job.zip: {reason}")):
        send_archive(alice, archive)

    assert alice.command("list") == jobs_before
    store = deployment.root / "server-workspace" / "jobs"
    assert [p.name for p in store.iterdir() if p.name.startswith(".")] == []
    assert list(deployment.root.rglob("evil.py")) == []
    submitted = alice.submit(job)
    assert alice.command("status", job_id=submitted["job_id"])["status"] == "SUBMITTED"
    assert alice.command("abort", job_id=submitted["job_id"])["status"] == "FINISHED_ABORTED"
