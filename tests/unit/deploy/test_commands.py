"""Admin commands on a server: what one admin may hold of it (submits, queued jobs, downloads, log reads).

A real server daemon runs here, started from a provisioned kit on 127.0.0.1; admins and a site
connect with their own kits' keys, send their commands over the network, and every job archive
and download goes through the download services of the cells, as in production.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import tracemalloc
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from engine.cells import Message, Reply
from engine.cells.log_limit import DEFAULT_BURST
from engine.deploy import commands, job_feed, protocol, results
from engine.deploy import server as deploy_server
from engine.deploy.admin import AdminSession
from engine.deploy.archive import archive_digest, pack_job, unpack_job
from engine.deploy.audit import read
from engine.deploy.commands import unknown_job
from engine.deploy.job_store import JobStoreError
from engine.deploy.server import ServerDaemon
from engine.provision import load_kit, load_project, provision
from engine.site import SiteEndpoint, SiteSettings
from engine.streaming.pull import download_file
from engine.streaming.service import CHANNEL, TOPIC_CHUNK, TOPIC_DONE

FEDAVG = Path(__file__).resolve().parents[3] / "jobs" / "fedavg"
LONG_AGO = (datetime.now(timezone.utc) - timedelta(seconds=results.RESULTS_GRACE_S + 60)).isoformat()
WAIT_S = 10.0
PROJECT = """\
name = commands
server {{ host = 127.0.0.1, port = {port}, org = a }}
sites = [ {{ name = site-1, org = a }} ]
admins = [
  {{ name = olga, org = a, role = project_admin }}
  {{ name = alice, org = a, role = lead }}
  {{ name = bob, org = a, role = lead }}
  {{ name = mia, org = b, role = member }}
]
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """A server daemon of a freshly provisioned project, and the sessions that connect to it.

    The daemon's download service is watched: `released` counts the offers it has let go after
    their receiver reported "done" (their folder is deleted by then).
    """

    def __init__(self, root: Path) -> None:
        (root / "project.conf").write_text(PROJECT.format(port=free_port()))
        self.kits = root / "kits"
        provision(load_project(root / "project.conf"), self.kits)
        self._opened = contextlib.ExitStack()  # closed last-opened first: the sessions, then the daemon
        self.daemon = ServerDaemon(load_kit(self.kits / "server"), root / "server-workspace").start()
        self._opened.callback(self.daemon.audit.close)
        self._opened.callback(self.daemon.stop)
        self.released = threading.Semaphore(0)
        self._watch_releases()
        self._sessions: dict[str, AdminSession] = {}

    def admin(self, name: str = "alice") -> SiteEndpoint:
        """The endpoint of ``name``'s admin session (``alice.<token>``), opened on first use."""
        if name not in self._sessions:
            self._sessions[name] = self._opened.enter_context(AdminSession(load_kit(self.kits / name)))
        return self._sessions[name].endpoint

    def site(self, name: str = "site-1") -> SiteEndpoint:
        """A site's cell, connected with the site's kit."""
        kit = load_kit(self.kits / name)
        settings = SiteSettings(kit.identity, kit.cell_settings(), kit.keys_dir)
        endpoint = SiteEndpoint.for_site(settings, {}, connect_to=kit.server.connect_address).start()
        self._opened.callback(endpoint.close)
        assert endpoint.cell.wait_connected(WAIT_S), f"{name} did not connect"
        return endpoint

    def offers(self) -> list[Path]:
        """The archives the server offers for download now (each in its own folder)."""
        return sorted(self.daemon.workspace.glob("download-*/results.zip"))

    def close(self) -> None:
        self._opened.close()

    def _watch_releases(self) -> None:
        cell, service = self.daemon.endpoint.cell, self.daemon.endpoint.service
        assert service is not None

        def done(message: Message) -> None:
            service._on_done(message)  # frees the offer and deletes its folder before it returns
            self.released.release()

        cell.unregister_handler(CHANNEL, TOPIC_DONE)
        cell.register_handler(CHANNEL, TOPIC_DONE, done)


@pytest.fixture(scope="module")
def fedavg_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_job(FEDAVG, tmp_path_factory.mktemp("upload") / "fedavg.zip")


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    # No site connects here, so no job could start; the scheduler would only parse the queued
    # jobs' configs alongside the submits' (pyhocon's parser is not thread-safe).
    monkeypatch.setattr(deploy_server, "SCHEDULE_INTERVAL_S", 3600.0)
    started = Server(tmp_path)
    yield started
    started.close()


@pytest.fixture
def daemon(server: Server) -> ServerDaemon:
    return server.daemon


def ask(endpoint: SiteEndpoint, command: str, **header: Any) -> Message:
    """Send one admin command to the server over the network; its reply, refused or not."""
    future = endpoint.cell.request_async(
        "server", protocol.ADMIN_CHANNEL, protocol.TOPIC_COMMAND, {"command": command, **header}, timeout_s=WAIT_S
    )
    return future.result(WAIT_S + 5.0)


def answer(reply: Message) -> Any:
    assert reply.ok, reply.reason
    return json.loads(bytes(reply.frames[0]))


def submit(admin: SiteEndpoint, fedavg_zip: Path) -> Message:
    """Offer a copy of the fedavg job archive from ``admin``'s cell and submit it, as `AdminSession.submit` does."""
    folder = Path(tempfile.mkdtemp(prefix="submit-", dir=fedavg_zip.parent))
    archive = shutil.copyfile(fedavg_zip, folder / "job.zip")
    assert admin.service is not None
    ref = admin.service.add_file(archive, protocol.ARCHIVE_CHUNK_BYTES, ["server"], 60.0, owned_folder=folder)
    return ask(admin, "submit", ref=ref, size=archive.stat().st_size, digest=archive_digest(archive))


def pull(server: Server, admin: SiteEndpoint, offer: dict[str, Any], dest: Path) -> Path:
    """Download the archive of a ``download`` answer into ``dest``, unpacked; wait until the server let it go."""
    dest.mkdir()
    archive = download_file(admin.cell, "server", offer["ref"], dest / "results.zip", per_request_timeout_s=WAIT_S)
    assert archive_digest(archive) == offer["digest"] and archive.stat().st_size == offer["size"]
    unpacked = unpack_job(archive, dest / offer["job_id"])
    assert server.released.acquire(timeout=WAIT_S), "the server never let the offer go"
    return unpacked


def hold_chunks(endpoint: SiteEndpoint) -> tuple[threading.Semaphore, threading.Semaphore]:
    """Hold every chunk ``endpoint`` serves until the test lets it through.

    Returns:
        ``held``, released as each chunk request arrives, and ``let_through``, which the test
        releases once per chunk it lets go.
    """
    held, let_through = threading.Semaphore(0), threading.Semaphore(0)
    service = endpoint.service
    assert service is not None

    def chunk(message: Message) -> Reply:
        held.release()
        assert let_through.acquire(timeout=WAIT_S), "the test never let the chunk through"
        return service._on_chunk(message)

    endpoint.cell.unregister_handler(CHANNEL, TOPIC_CHUNK)
    endpoint.cell.register_handler(CHANNEL, TOPIC_CHUNK, chunk)
    return held, let_through


def finished(daemon: ServerDaemon, job_id: str, finished_at: str = LONG_AGO) -> None:
    """The job ran and ended (no site runs jobs here: its record says so)."""
    daemon.store.update(job_id, status="FINISHED_COMPLETED", finished_at=finished_at)


def audited(daemon: ServerDaemon) -> list[tuple[str, str, str]]:
    return [(r["actor"], r["action"], r["outcome"]) for r in read(daemon.audit.path)]


def refusals_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == commands.__name__]


# ----------------------------------------------------------------- submit


def test_a_submit_pulls_the_job_from_the_admin_and_queues_it(server: Server, fedavg_zip: Path) -> None:
    alice = server.admin()

    record = answer(submit(alice, fedavg_zip))

    assert record["submitter"] == "alice" and record["status"] == "SUBMITTED"
    assert record["digest"] == archive_digest(server.daemon.store.archive(record["job_id"]))
    assert alice.chunks_served == 1  # the archive is one chunk, pulled once


def test_an_admin_has_at_most_two_submits_in_progress(server: Server, fedavg_zip: Path) -> None:
    alice, bob = server.admin("alice"), server.admin("bob")
    held, let_through = hold_chunks(alice)
    replies: list[Message] = []
    answered = threading.Condition()

    def submitting() -> None:
        reply = submit(alice, fedavg_zip)
        with answered:
            replies.append(reply)
            answered.notify_all()

    threads = [threading.Thread(target=submitting) for _ in range(2)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert held.acquire(timeout=WAIT_S)  # the server is pulling both archives

    third = submit(alice, fedavg_zip)
    by_bob = submit(bob, fedavg_zip)  # done while alice's two are still held
    for count in (1, 2):  # one at a time: pyhocon is not thread-safe, two job configs parsed at once can misparse
        let_through.release()
        with answered:
            assert answered.wait_for(lambda count=count: len(replies) == count, WAIT_S)
    for thread in threads:
        thread.join(WAIT_S)

    assert not third.ok
    assert third.reason == "alice has 2 submits in progress already; busy, try again once one has finished"
    assert by_bob.ok, by_bob.reason
    assert [reply.ok for reply in replies] == [True, True], [reply.reason for reply in replies]
    let_through.release()
    assert submit(alice, fedavg_zip).ok  # the slots are free again


def test_an_admin_has_at_most_max_queued_jobs_waiting(
    server: Server, fedavg_zip: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "MAX_QUEUED_JOBS", 2)
    alice = server.admin()
    first = answer(submit(alice, fedavg_zip))
    answer(submit(alice, fedavg_zip))

    refused = submit(alice, fedavg_zip)

    assert not refused.ok
    assert refused.reason == (
        "you have 2 jobs waiting, the most an admin may have (2); abort one or wait until one has started"
    )
    assert alice.chunks_served == 2  # refused before a byte was pulled
    assert submit(server.admin("bob"), fedavg_zip).ok  # the quota is per admin
    answer(ask(alice, "abort", job_id=first["job_id"]))
    assert submit(alice, fedavg_zip).ok


# ----------------------------------------------------------------- download


def test_a_finished_job_is_packed_once_and_every_download_is_a_link_to_that_file(
    server: Server, daemon: ServerDaemon, fedavg_zip: Path, tmp_path: Path
) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    (daemon.store.workspace(job_id) / "server").mkdir()
    (daemon.store.workspace(job_id) / "server" / "log.txt").write_text("round 1\n")
    finished(daemon, job_id)

    first = answer(ask(alice, "download", job_id=job_id))
    kept = daemon.store.results_archive(job_id)
    packed = kept.stat()
    got = pull(server, alice, first, tmp_path / "first")
    second = answer(ask(alice, "download", job_id=job_id))
    [served] = server.offers()

    assert (got / "server" / "log.txt").read_text() == "round 1\n"
    assert first["digest"] == second["digest"] == archive_digest(kept)
    assert first["size"] == second["size"] == kept.stat().st_size
    assert served.stat().st_ino == kept.stat().st_ino == packed.st_ino  # linked, not packed again
    assert kept.stat().st_mtime_ns == packed.st_mtime_ns
    pull(server, alice, second, tmp_path / "second")  # the service deletes what it was given...
    assert server.offers() == [] and kept.is_file()  # ...the kept archive stays


@pytest.mark.parametrize(
    ("limit", "value", "reason"),
    [
        ("RESULTS_MAX_FILES", 1, r"holds \d+ files and folders, over the limit of 1"),
        ("RESULTS_MAX_BYTES", 4, r"holds \d+ bytes, over the limit of 4"),
    ],
    ids=["files", "bytes"],
)
def test_a_job_is_packed_within_the_results_limits(
    server: Server,
    daemon: ServerDaemon,
    fedavg_zip: Path,
    monkeypatch: pytest.MonkeyPatch,
    limit: str,
    value: int,
    reason: str,
) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    (daemon.store.workspace(job_id) / "server").mkdir()
    (daemon.store.workspace(job_id) / "server" / "log.txt").write_text("round 1\n")
    finished(daemon, job_id)
    monkeypatch.setattr(protocol, limit, value)

    refused = ask(alice, "download", job_id=job_id)

    assert not refused.ok
    assert re.fullmatch(re.escape(f"job {job_id}: ") + reason, refused.reason), refused.reason  # no server path
    assert server.offers() == [] and not daemon.store.results_archive(job_id).exists()


def test_a_job_that_just_ended_is_packed_afresh_as_results_may_still_come(
    server: Server, daemon: ServerDaemon, fedavg_zip: Path, tmp_path: Path
) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    finished(daemon, job_id, finished_at=datetime.now(timezone.utc).isoformat())

    first = answer(ask(alice, "download", job_id=job_id))
    [served] = server.offers()
    assert served.stat().st_nlink == 1  # its own archive, no kept one
    pull(server, alice, first, tmp_path / "first")
    (daemon.store.workspace(job_id) / "site-1").mkdir()  # a site's results land after the first download
    (daemon.store.workspace(job_id) / "site-1" / "log.txt").write_text("late\n")
    second = pull(server, alice, answer(ask(alice, "download", job_id=job_id)), tmp_path / "second")

    assert not daemon.store.results_archive(job_id).exists()
    assert (second / "site-1" / "log.txt").read_text() == "late\n"


def test_an_admin_has_at_most_two_downloads_offered_at_once(
    server: Server, daemon: ServerDaemon, fedavg_zip: Path, tmp_path: Path
) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    finished(daemon, job_id)
    offers = [answer(ask(alice, "download", job_id=job_id)) for _ in range(2)]

    third = ask(alice, "download", job_id=job_id)

    assert not third.ok
    assert third.reason.startswith("alice has 2 downloads in progress already; busy, try again once one has finished")
    assert len(server.offers()) == 2
    assert ("alice", "download", "refused") in audited(daemon)
    pull(server, alice, offers[0], tmp_path / "pulled")
    assert ask(alice, "download", job_id=job_id).ok


# ----------------------------------------------------------------- logs


def test_logs_returns_the_last_lines(server: Server, daemon: ServerDaemon, fedavg_zip: Path) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    (daemon.store.workspace(job_id) / "server").mkdir()
    (daemon.store.workspace(job_id) / "server" / "log.txt").write_text("".join(f"line {i}\n" for i in range(100_000)))

    lines = answer(ask(alice, "logs", job_id=job_id))["lines"]

    assert lines == [f"line {i}" for i in range(100_000 - job_feed.LOG_LINES, 100_000)]


def test_logs_reads_only_the_end_of_a_huge_log(server: Server, daemon: ServerDaemon, fedavg_zip: Path) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    log_file = daemon.store.workspace(job_id) / "server" / "log.txt"
    log_file.parent.mkdir()
    with log_file.open("wb") as out:  # 64 MiB, sparse: a site's huge log costs no disk here
        out.truncate(64 << 20)
        out.seek(0, os.SEEK_END)
        out.write(b"\nlast line\n")

    tracemalloc.start()  # traces the server's handler thread too: it runs in this process
    try:
        lines = answer(ask(alice, "logs", job_id=job_id))["lines"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert lines[-1] == "last line"
    assert peak < 16 * job_feed.LOG_TAIL_BYTES


# ----------------------------------------------------------------- delete


def test_a_finished_job_is_deleted_by_who_may_abort_it(server: Server, daemon: ServerDaemon, fedavg_zip: Path) -> None:
    alice, bob = server.admin("alice"), server.admin("bob")
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    finished(daemon, job_id)
    answer(ask(alice, "download", job_id=job_id))  # a kept results.zip goes with the job
    assert daemon.store.results_archive(job_id).is_file()

    by_bob = ask(bob, "delete", job_id=job_id)
    deleted = answer(ask(alice, "delete", job_id=job_id))

    assert not by_bob.ok
    assert by_bob.reason.startswith("delete needs the right to abort the job: lead bob may abort their own jobs only;")
    assert deleted == {"job_id": job_id, "deleted": True}
    assert daemon.store.list() == [] and not (daemon.store.root / job_id).exists()
    assert ("bob", "delete", "refused") in audited(daemon) and ("alice", "delete", "ok") in audited(daemon)
    assert ask(alice, "status", job_id=job_id).reason == f"no job {job_id}"


def test_a_job_that_has_not_ended_is_not_deleted(server: Server, daemon: ServerDaemon, fedavg_zip: Path) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]

    refused = ask(alice, "delete", job_id=job_id)

    assert not refused.ok
    assert refused.reason == f"job {job_id} is SUBMITTED; abort it first, or wait until it has ended"
    assert daemon.store.get(job_id).status == "SUBMITTED"


# ----------------------------------------------------------------- refusals


@pytest.mark.parametrize("command", ["status", "abort", "delete", "download", "logs", "watch"])
def test_a_job_an_admin_may_not_see_is_answered_as_an_unknown_id(
    server: Server, daemon: ServerDaemon, fedavg_zip: Path, command: str
) -> None:
    job_id = answer(submit(server.admin("alice"), fedavg_zip))["job_id"]
    made_up = "0123456789ab"

    hidden, unknown = (
        ask(server.admin("mia"), command, job_id=job_id),
        ask(server.admin("mia"), command, job_id=made_up),
    )

    assert (hidden.status, hidden.reason) == (unknown.status, unknown.reason.replace(made_up, job_id))
    assert hidden.reason == unknown_job(job_id)
    with pytest.raises(JobStoreError, match=f"^{unknown_job(made_up)}$"):  # the store's own words
        daemon.store.get(made_up)
    refusals = [e for e in read(daemon.audit.path) if e["actor"] == "mia" and e.get("job") == job_id]
    assert [e["reason"] for e in refusals] == ["the job is not visible to member mia"]  # the audit log knows


def test_a_huge_command_name_is_clipped_in_the_audit_log_the_log_and_the_reply(
    server: Server, daemon: ServerDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    huge = "x" * (512 << 10)  # about as big as a message to the server may be (its envelope takes 1 MiB at most)

    with caplog.at_level(logging.WARNING, logger=commands.__name__):
        reply = ask(server.admin(), huge)

    [line] = [r for r in read(daemon.audit.path) if r["actor"] == "alice"]
    assert not reply.ok and len(reply.reason) < 1000
    assert len(json.dumps(line)) < 2000
    assert [len(record.getMessage()) < 2000 for record in refusals_logged(caplog)] == [True]


def test_refusal_log_lines_are_rate_limited(
    server: Server, daemon: ServerDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    site = server.site()  # a participant of the project, but no admin

    with caplog.at_level(logging.WARNING, logger=commands.__name__):
        replies = [ask(site, "list") for _ in range(DEFAULT_BURST + 30)]

    assert {reply.reason for reply in replies} == {"site-1 is not an admin of this project"}
    assert len(refusals_logged(caplog)) == DEFAULT_BURST
    assert audited(daemon).count(("site-1", "list", "refused")) == DEFAULT_BURST + 30  # the audit log keeps every one


def test_a_job_that_brings_its_own_code_needs_the_byoc_right() -> None:
    from engine.config import load_job
    from engine.deploy.commands import _byoc_refusal
    from engine.provision.project import Participant

    job = load_job(FEDAVG, build=False, environment=False)
    org_admin = Participant("olga", "admin", "hospital-a", "org_admin")
    lead = Participant("bob", "admin", "hospital-a", "lead")

    refusal = _byoc_refusal(org_admin, job)

    assert refusal is not None and refusal.startswith("the job brings its own code (app/custom/ (")
    assert "org_admin olga may not" in refusal
    assert _byoc_refusal(lead, job) is None


# ----------------------------------------------------------------- download: the job's summary.json


def test_a_job_aborted_before_it_ran_downloads_with_its_summary(
    server: Server, daemon: ServerDaemon, fedavg_zip: Path, tmp_path: Path
) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    answer(ask(alice, "abort", job_id=job_id))

    got = pull(server, alice, answer(ask(alice, "download", job_id=job_id)), tmp_path / "got")

    summary = json.loads((got / "summary.json").read_text())
    assert summary["status"] == "FINISHED_ABORTED" and summary["reason"] == "aborted by alice: abort command"
    assert [entry["state"] for entry in summary["states"]] == ["SUBMITTED", "FINISHED_ABORTED"]
    assert summary["rounds"] == [] and summary["processes"] == {"server": {"exit_code": None, "peak_rss_mb": None}}


def test_results_that_come_in_after_a_download_are_in_the_next_downloads_summary(
    server: Server, daemon: ServerDaemon, fedavg_zip: Path, tmp_path: Path
) -> None:
    alice = server.admin()
    job_id = answer(submit(alice, fedavg_zip))["job_id"]
    daemon.store.update(job_id, status="RUNNING", sites=["site-1"])
    finished(daemon, job_id, finished_at=datetime.now(timezone.utc).isoformat())  # results may still come
    first = pull(server, alice, answer(ask(alice, "download", job_id=job_id)), tmp_path / "first")
    daemon.store.record_exit(job_id, "site-1", 0)  # the site's job process ended; its results land
    (daemon.store.workspace(job_id) / "site-1").mkdir()
    (daemon.store.workspace(job_id) / "site-1" / "process.json").write_text('{"peak_rss_bytes": 1048576}')

    second = pull(server, alice, answer(ask(alice, "download", job_id=job_id)), tmp_path / "second")

    before, after = (json.loads((folder / "summary.json").read_text()) for folder in (first, second))
    assert before["processes"]["site-1"] == {"exit_code": None, "peak_rss_mb": None}
    assert before["warnings"] == ["site-1 handed in no results: its memory, metrics and log are not here"]
    assert after["processes"]["site-1"] == {"exit_code": 0, "peak_rss_mb": 1.0} and after["warnings"] == []


def test_two_threads_stopping_the_server_at_once_both_return_cleanly(server: Server) -> None:
    """``admin shutdown``'s timer and the main thread it wakes both call stop: neither may fail."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def stop() -> None:
        barrier.wait()
        try:
            server.daemon.stop("shutdown")
        except BaseException as e:  # noqa: BLE001 - the test reports whatever escaped
            errors.append(e)

    stoppers = [threading.Thread(target=stop) for _ in range(2)]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join(30)
    assert errors == [] and server.daemon.stopped.is_set()
    assert server.daemon._endpoint is None
