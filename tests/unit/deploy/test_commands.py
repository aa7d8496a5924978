"""Admin commands on a server: what one admin may hold of it (submits, queued jobs, downloads, log reads)."""

from __future__ import annotations

import json
import logging
import os
import threading
import tracemalloc
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from engine.cells import Message, Reply, Status
from engine.cells.envelope import Envelope
from engine.cells.log_limit import DEFAULT_BURST
from engine.cells.protocol import Kind
from engine.deploy import commands, protocol, results
from engine.deploy.archive import archive_digest, pack_job
from engine.deploy.audit import AuditLog, read
from engine.deploy.commands import AdminCommands
from engine.deploy.job_store import JobRecord, JobStore
from engine.provision.project import Participant
from engine.streaming.service import DEFAULT_MIN_THROUGHPUT

FEDAVG = Path(__file__).resolve().parents[3] / "jobs" / "fedavg"
LONG_AGO = (datetime.now(timezone.utc) - timedelta(seconds=results.RESULTS_GRACE_S + 60)).isoformat()


class FakeService:
    """The server's download service: keeps what is offered until the test says it was pulled."""

    def __init__(self) -> None:
        self.offers: list[tuple[Path, Path | None]] = []

    def add_file(
        self, path: Path, chunk_bytes: int, receivers: list[str], timeout_s: float, owned_folder: Path | None = None
    ) -> str:
        self.offers.append((path, owned_folder))
        return f"ref-{len(self.offers)}"

    def pulled(self, index: int) -> None:
        """The admin pulled offer ``index``: the service deletes its folder, as `DownloadService` does."""
        path, folder = self.offers[index]
        path.unlink()
        if folder is not None:
            folder.rmdir()


class FakeEndpoint:
    def __init__(self) -> None:
        self.cell = object()
        self.service = FakeService()


class FakeKit:
    identity = "server"


class FakeDaemon:
    """What `AdminCommands` uses of a `ServerDaemon`: a real job store and audit log, no cells."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        self.kit = FakeKit()
        self.participants = {
            "alice": Participant("alice", "admin", "a", "lead"),
            "bob": Participant("bob", "admin", "a", "lead"),
            "carol": Participant("carol", "admin", "a", "member"),
            "site-1": Participant("site-1", "site", "a"),
        }
        self.store = JobStore(workspace / "jobs")
        self.audit = AuditLog(workspace / "audit.log")
        self.endpoint = FakeEndpoint()

    def waiting_reason(self, job_id: str) -> str | None:
        return None

    def abort_job(self, job_id: str, actor: str, reason: str) -> JobRecord:
        return self.store.update(job_id, status="FINISHED_ABORTED", finished_at=LONG_AGO, reason=reason)


class FakeDownloads:
    """Stands in for `download_file` on submit: hands over the fedavg job, optionally held at a gate."""

    def __init__(self, archive: Path) -> None:
        self.archive = archive
        self.calls: list[dict[str, Any]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.inside = threading.Semaphore(0)

    def __call__(self, cell: object, source: str, ref: str, path: Path, **kwargs: Any) -> Path:
        self.calls.append(kwargs)
        self.inside.release()
        assert self.gate.wait(10.0), "the test never opened the gate"
        path.write_bytes(self.archive.read_bytes())
        return path


@pytest.fixture(scope="module")
def fedavg_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_job(FEDAVG, tmp_path_factory.mktemp("upload") / "fedavg.zip")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[FakeDaemon]:
    daemon = FakeDaemon(tmp_path / "server-workspace")
    yield daemon
    daemon.audit.close()


@pytest.fixture
def admin(daemon: FakeDaemon) -> AdminCommands:
    return AdminCommands(daemon)  # type: ignore[arg-type]


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch, fedavg_zip: Path) -> FakeDownloads:
    fake = FakeDownloads(fedavg_zip)
    monkeypatch.setattr(commands, "download_file", fake)
    return fake


def ask(admin: AdminCommands, who: str, command: str, **header: Any) -> Reply:
    envelope = Envelope(
        Kind.REQUEST, 1, f"{who}.5e1f", "server", "admin", "command", header={"command": command, **header}
    )
    return admin.handle(Message(envelope))


def answer(reply: Reply) -> Any:
    assert reply.status is Status.OK, reply.reason
    return json.loads(bytes(reply.frames[0]))


def submit(admin: AdminCommands, who: str = "alice", size: int = 1000) -> Reply:
    return ask(admin, who, "submit", ref="r1", size=size)


def finished(daemon: FakeDaemon, job_id: str, finished_at: str = LONG_AGO) -> None:
    daemon.store.update(job_id, status="FINISHED_COMPLETED", finished_at=finished_at)


def audited(daemon: FakeDaemon) -> list[tuple[str, str, str]]:
    return [(r["actor"], r["action"], r["outcome"]) for r in read(daemon.audit.path)]


# ----------------------------------------------------------------- submit


def test_a_submit_is_pulled_with_the_engine_throughput_floor(admin: AdminCommands, downloads: FakeDownloads) -> None:
    record = answer(submit(admin))

    assert record["submitter"] == "alice" and record["status"] == "SUBMITTED"
    assert downloads.calls[0]["min_throughput"] == DEFAULT_MIN_THROUGHPUT


def test_an_admin_has_at_most_two_submits_in_progress(admin: AdminCommands, downloads: FakeDownloads) -> None:
    downloads.gate.clear()
    replies: list[Reply] = []
    threads = [threading.Thread(target=lambda: replies.append(submit(admin))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert downloads.inside.acquire(timeout=10.0)

    third = submit(admin)
    other_admin = threading.Thread(target=lambda: replies.append(submit(admin, "bob")))
    other_admin.start()
    assert downloads.inside.acquire(timeout=10.0)  # bob's submit is not held up by alice's
    downloads.gate.set()
    for thread in [*threads, other_admin]:
        thread.join(10.0)

    assert third.status is Status.ERROR
    assert third.reason == "alice has 2 submits in progress already; busy, try again once one has finished"
    assert [reply.status for reply in replies] == [Status.OK] * 3
    assert submit(admin).status is Status.OK  # the slots are free again


def test_an_admin_has_at_most_max_queued_jobs_waiting(
    admin: AdminCommands, daemon: FakeDaemon, downloads: FakeDownloads, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "MAX_QUEUED_JOBS", 2)
    first = answer(submit(admin))
    answer(submit(admin))

    refused = submit(admin)

    assert refused.status is Status.ERROR
    assert refused.reason == (
        "you have 2 jobs waiting, the most an admin may have (2); abort one or wait until one has started"
    )
    assert len(downloads.calls) == 2  # refused before a byte was pulled
    assert submit(admin, "bob").status is Status.OK  # the quota is per admin
    answer(ask(admin, "alice", "abort", job_id=first["job_id"]))
    assert submit(admin).status is Status.OK


# ----------------------------------------------------------------- download


def test_a_finished_job_is_packed_once_and_every_download_is_a_link_to_that_file(
    admin: AdminCommands, daemon: FakeDaemon, downloads: FakeDownloads, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = answer(submit(admin))["job_id"]
    (daemon.store.workspace(job_id) / "server").mkdir()
    (daemon.store.workspace(job_id) / "server" / "log.txt").write_text("round 1\n")
    finished(daemon, job_id)
    packed: list[dict[str, int]] = []

    def counting_pack(folder: Path, dest: Path, **limits: int) -> Path:
        packed.append(limits)
        return pack_job(folder, dest, **limits)

    monkeypatch.setattr(commands, "pack_job", counting_pack)

    first = answer(ask(admin, "alice", "download", job_id=job_id))
    daemon.endpoint.service.pulled(0)
    second = answer(ask(admin, "alice", "download", job_id=job_id))

    kept = daemon.store.results_archive(job_id)
    assert packed == [{"max_files": protocol.RESULTS_MAX_FILES, "max_bytes": protocol.RESULTS_MAX_BYTES}]
    assert first["digest"] == second["digest"] == archive_digest(kept)
    assert first["size"] == second["size"] == kept.stat().st_size
    served, folder = daemon.endpoint.service.offers[1]
    assert served.stat().st_ino == kept.stat().st_ino and folder == served.parent
    daemon.endpoint.service.pulled(1)  # the service deletes what it was given: the kept archive stays
    assert kept.is_file()


def test_a_job_that_just_ended_is_packed_afresh_as_results_may_still_come(
    admin: AdminCommands, daemon: FakeDaemon, downloads: FakeDownloads
) -> None:
    job_id = answer(submit(admin))["job_id"]
    finished(daemon, job_id, finished_at=datetime.now(timezone.utc).isoformat())

    answer(ask(admin, "alice", "download", job_id=job_id))

    assert not daemon.store.results_archive(job_id).exists()
    served, folder = daemon.endpoint.service.offers[0]
    assert served.is_file() and folder == served.parent


def test_an_admin_has_at_most_two_downloads_offered_at_once(
    admin: AdminCommands, daemon: FakeDaemon, downloads: FakeDownloads
) -> None:
    job_id = answer(submit(admin))["job_id"]
    finished(daemon, job_id)
    for _ in range(2):
        answer(ask(admin, "alice", "download", job_id=job_id))

    third = ask(admin, "alice", "download", job_id=job_id)

    assert third.status is Status.ERROR
    assert third.reason.startswith("alice has 2 downloads in progress already; busy, try again once one has finished")
    assert len(daemon.endpoint.service.offers) == 2
    assert ("alice", "download", "refused") in audited(daemon)
    daemon.endpoint.service.pulled(0)
    assert ask(admin, "alice", "download", job_id=job_id).status is Status.OK


# ----------------------------------------------------------------- logs


def test_logs_returns_the_last_lines(admin: AdminCommands, daemon: FakeDaemon, downloads: FakeDownloads) -> None:
    job_id = answer(submit(admin))["job_id"]
    (daemon.store.workspace(job_id) / "server").mkdir()
    (daemon.store.workspace(job_id) / "server" / "log.txt").write_text("".join(f"line {i}\n" for i in range(100_000)))

    lines = answer(ask(admin, "alice", "logs", job_id=job_id))["lines"]

    assert lines == [f"line {i}" for i in range(100_000 - commands.LOG_LINES, 100_000)]


def test_logs_reads_only_the_end_of_a_huge_log(
    admin: AdminCommands, daemon: FakeDaemon, downloads: FakeDownloads
) -> None:
    job_id = answer(submit(admin))["job_id"]
    log_file = daemon.store.workspace(job_id) / "server" / "log.txt"
    log_file.parent.mkdir()
    with log_file.open("wb") as out:  # 64 MiB, sparse: a site's huge log costs no disk here
        out.truncate(64 << 20)
        out.seek(0, os.SEEK_END)
        out.write(b"\nlast line\n")

    tracemalloc.start()
    try:
        lines = answer(ask(admin, "alice", "logs", job_id=job_id))["lines"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert lines[-1] == "last line"
    assert peak < 16 * commands.LOG_TAIL_BYTES


# ----------------------------------------------------------------- delete


def test_a_finished_job_is_deleted_by_who_may_abort_it(
    admin: AdminCommands, daemon: FakeDaemon, downloads: FakeDownloads
) -> None:
    job_id = answer(submit(admin))["job_id"]
    finished(daemon, job_id)
    answer(ask(admin, "alice", "download", job_id=job_id))  # a kept results.zip goes with the job

    by_bob = ask(admin, "bob", "delete", job_id=job_id)
    deleted = answer(ask(admin, "alice", "delete", job_id=job_id))

    assert by_bob.status is Status.ERROR
    assert by_bob.reason.startswith("delete needs the right to abort the job: lead bob may abort their own jobs only;")
    assert deleted == {"job_id": job_id, "deleted": True}
    assert daemon.store.list() == [] and not (daemon.store.root / job_id).exists()
    assert ("bob", "delete", "refused") in audited(daemon) and ("alice", "delete", "ok") in audited(daemon)
    assert ask(admin, "alice", "status", job_id=job_id).reason == f"no job {job_id}"


def test_a_job_that_has_not_ended_is_not_deleted(
    admin: AdminCommands, daemon: FakeDaemon, downloads: FakeDownloads
) -> None:
    job_id = answer(submit(admin))["job_id"]

    refused = ask(admin, "alice", "delete", job_id=job_id)

    assert refused.status is Status.ERROR
    assert refused.reason == f"job {job_id} is SUBMITTED; abort it first, or wait until it has ended"
    assert daemon.store.get(job_id).status == "SUBMITTED"


# ----------------------------------------------------------------- refusals


def test_a_huge_command_name_is_clipped_in_the_audit_log_the_log_and_the_reply(
    admin: AdminCommands, daemon: FakeDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    huge = "x" * (1 << 20)

    with caplog.at_level(logging.WARNING, logger=commands.__name__):
        reply = ask(admin, "alice", huge)

    assert reply.status is Status.ERROR and len(reply.reason) < 1000
    assert daemon.audit.path.stat().st_size < 2000
    assert [len(record.getMessage()) < 2000 for record in caplog.records] == [True]


def test_refusal_log_lines_are_rate_limited(
    admin: AdminCommands, daemon: FakeDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=commands.__name__):
        for _ in range(DEFAULT_BURST + 30):
            ask(admin, "mallory", "list")

    assert len(caplog.records) == DEFAULT_BURST
    assert len(read(daemon.audit.path)) == DEFAULT_BURST + 30  # the audit log keeps every one


def test_a_job_that_brings_its_own_code_needs_the_byoc_right() -> None:
    from engine.config import load_job
    from engine.deploy.commands import _byoc_refusal
    from engine.provision.project import Participant

    job = load_job(Path(__file__).resolve().parents[3] / "jobs" / "fedavg", build=False, environment=False)
    org_admin = Participant("olga", "admin", "hospital-a", "org_admin")
    lead = Participant("bob", "admin", "hospital-a", "lead")

    refusal = _byoc_refusal(org_admin, job)

    assert refusal is not None and refusal.startswith("the job brings its own code (app/custom/ (")
    assert "org_admin olga may not" in refusal
    assert _byoc_refusal(lead, job) is None
