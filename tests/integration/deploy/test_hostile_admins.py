"""Production mode attacked by admins, with real daemons (issue 37, points 2 and 5).

- An admin with another project's kit is refused at the handshake: ``flengine admin`` fails at
  once with one line, not after its connect timeout.
- A member asking about another organisation's job reads exactly what a made-up job id reads.
- A job archive of 600,000 empty members is refused before it costs the server memory: the
  server daemon's RSS, read from ``/proc`` outside it, grows by less than 32 MiB.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from engine.deploy import protocol
from engine.deploy.admin import AdminError, AdminSession
from engine.deploy.archive import archive_digest
from engine.provision import load_kit
from tests.integration.deploy.test_production import SITES, Deployment, deployment  # noqa: F401
from tests.integration.runtime.jobkit import make_bench_job
from tests.zip_directories import empty_members

#: How much the server's RSS may grow while it refuses the 600,000-member archive.
MAX_GROWTH_BYTES = 32 << 20
MADE_UP_ID = "0123456789ab"


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid``, from ``/proc/PID/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS line for process {pid}")


class PeakRss:
    """Samples the RSS of a process every 10 ms from another thread while the ``with`` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = rss_bytes(pid)
        self.peak = self.before
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5.0)
        self.peak = max(self.peak, rss_bytes(self.pid))

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, rss_bytes(self.pid))


@pytest.fixture
def project(deployment: Deployment) -> Deployment:  # noqa: F811
    """A provisioned project whose server daemon runs (no site: every job stays SUBMITTED)."""
    deployment.start("server", "server")
    return deployment


def test_an_admin_with_another_projects_kit_fails_at_once_with_one_line(project: Deployment, tmp_path: Path) -> None:
    other = Deployment(tmp_path / "other")
    other.port = project.port  # the same address, another project: another server key
    other.provision(SITES)

    started = time.monotonic()
    refused = other.admin("alice", "list")
    took_s = time.monotonic() - started

    assert refused.returncode == 1, refused.stderr
    assert took_s < 3.0, f"the refused admin took {took_s:.1f} s"
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith("Error: the server at tcp://127.0.0.1:") and "refused the kit of 'alice'" in lines[0]
    assert "another project" in lines[0] and "revoked" in lines[0]
    assert project.admin("alice", "list").returncode == 0  # the server's own admin is still let in


@pytest.mark.slow  # end to end and long; CI runs it with -m slow
def test_a_member_cannot_tell_another_orgs_job_from_a_made_up_id(project: Deployment, tmp_path: Path) -> None:
    job_id = project.admin_json("alice", "submit", str(make_bench_job(tmp_path / "jobs")))["job_id"]

    for command in ("status", "watch", "download", "logs", "abort", "delete"):
        hidden = project.admin("carol", command, job_id)  # carol: a member of hospital-2; the job is lab's
        made_up = project.admin("carol", command, MADE_UP_ID)

        assert (hidden.returncode, hidden.stdout) == (made_up.returncode, made_up.stdout) == (1, ""), command
        assert hidden.stderr.replace(job_id, "<id>") == made_up.stderr.replace(MADE_UP_ID, "<id>"), command
        assert hidden.stderr == f"Error: no job {job_id}\n", command
    assert project.admin_json("alice", "status", job_id)["status"] == "SUBMITTED"  # abort and delete did nothing


def test_a_job_archive_of_600000_empty_members_is_refused_before_it_costs_the_server_memory(
    project: Deployment, tmp_path: Path
) -> None:
    server = project.daemons["server"]
    folder = Path(tempfile.mkdtemp(prefix="bomb-", dir=tmp_path))
    archive = empty_members(folder / "job.zip", 600_000)
    size, digest = archive.stat().st_size, archive_digest(archive)

    with AdminSession(load_kit(project.kits / "alice")) as admin:
        assert admin.endpoint.service is not None
        ref = admin.endpoint.service.add_file(
            archive, protocol.ARCHIVE_CHUNK_BYTES, ["server"], 60.0, owned_folder=folder
        )
        with PeakRss(server.pid) as rss, pytest.raises(AdminError) as refused:
            admin.command("submit", ref=ref, size=size, digest=digest)
    shutil.rmtree(folder, ignore_errors=True)

    growth = rss.peak - rss.before
    print(
        f"server RSS {rss.before >> 20} MiB, peak {rss.peak >> 20} MiB: {growth / (1 << 20):.1f} MiB for {size} bytes"
    )
    assert "more than 10000 members (600000 declared by its end record)" in str(refused.value)
    assert growth < MAX_GROWTH_BYTES, f"the server grew by {growth >> 20} MiB"
    assert project.admin_json("alice", "list") == []
