"""`AdminCommands`: what the server daemon answers to admin sessions, each authorized and audited.

One request per command on ``admin/command``, header ``command`` plus its args; the answer is
one JSON body frame (`reply_json`), or an error reply whose reason the admin tool prints. The
admin is the identity of the session's key (its cell is ``alice.<token>``), its role and org
come from the server kit's ``participants.json``; `engine.deploy.authz` decides, and every
command, allowed or not, is a line of the audit log. A job the admin may not see (`visible`) is
answered exactly as an id that names no job (`unknown_job`), whatever the command.

What one admin may hold of the server is bounded: `MAX_SUBMITS_PER_ADMIN` submits in progress,
`MAX_QUEUED_JOBS` jobs waiting, `MAX_DOWNLOADS_PER_ADMIN` download offers not yet pulled; a
finished job's results are packed once (``<job>/results.zip``) and every later download is
served from that file. ``watch`` and ``logs --follow`` poll with a cursor; one answer reads at
most `engine.deploy.job_feed.FEED_MAX_BYTES` of the file, whatever the cursor says.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.cells import Message, Reply, Status
from engine.cells.log_limit import REFUSALS
from engine.config import Job, job_code_of
from engine.deploy import protocol
from engine.deploy.archive import JobArchiveError, archive_digest, pack_job
from engine.deploy.audit import clip
from engine.deploy.authz import authorize, visible
from engine.deploy.job_feed import cursor_of, read_from, tail, watch_answer
from engine.deploy.job_store import JobRecord
from engine.deploy.results import results_settled
from engine.deploy.transfer import pull_archive
from engine.errors import FlengineError
from engine.provision.project import Participant
from engine.runtime.process import EVENTS_FILE, LOG_FILE

if TYPE_CHECKING:  # the daemon starts these commands; they only need its type
    from engine.deploy.server import ServerDaemon

log = logging.getLogger(__name__)

#: Submits one admin may have in progress at once (each holds a thread and up to 1 GiB of disk).
MAX_SUBMITS_PER_ADMIN = 2
#: Jobs one admin may have waiting to run (SUBMITTED) at once.
MAX_QUEUED_JOBS = 10
#: Download offers one admin may have outstanding (neither pulled nor expired) at once.
MAX_DOWNLOADS_PER_ADMIN = 2
#: Seconds a download offer waits for the admin's next request before it is dropped.
DOWNLOAD_TIMEOUT_S = 300.0


class AdminCommands:
    """The admin command handlers of a `ServerDaemon`."""

    def __init__(self, daemon: ServerDaemon) -> None:
        self.daemon = daemon
        self._commands: dict[str, Callable[[Participant, Message], Reply]] = {
            "submit": self._submit,
            "list": self._list,
            "status": self._status,
            "abort": self._abort,
            "delete": self._delete,
            "download": self._download,
            "logs": self._logs,
            "watch": self._watch,
            "clients": self._clients,
            "shutdown": self._shutdown,
        }
        self._lock = threading.Lock()  # guards the three dicts below
        self._submitting: dict[str, int] = {}  # admin -> submits in progress
        self._offers: dict[str, list[Path]] = {}  # admin -> owned folders of its download offers
        self._packing: dict[str, threading.Lock] = {}  # job id -> held while its results.zip is made
        self._digests: dict[str, str] = {}  # job id -> digest of its results.zip

    def handle(self, message: Message) -> Reply:
        """Authorize and run one command; never raises (an error is the reply)."""
        identity = message.source.split(".", 1)[0]
        command = str(message.header.get("command", ""))
        user = self.daemon.participants.get(identity)
        if user is None or user.kind != "admin":
            return self._refuse(identity, command, f"{clip(identity)} is not an admin of this project")
        handler = self._commands.get(command)
        if handler is None:
            return self._refuse(
                identity, command, f"unknown command {clip(command)!r}; known: {', '.join(self._commands)}"
            )
        try:
            return handler(user, message)
        except FlengineError as e:
            return self._refuse(identity, command, str(e))
        except Exception as e:  # a bug must not take the server down; the admin sees what failed
            log.exception("admin command failed: %s by %s", command, identity)
            return self._refuse(identity, command, f"{type(e).__name__}: {e}")

    # ----------------------------------------------------------------- commands

    def _submit(self, user: Participant, message: Message) -> Reply:
        denied = authorize(user, "submit")
        if denied:
            return self._refuse(user.name, "submit", denied)
        ref, size, digest = message.header.get("ref"), message.header.get("size"), message.header.get("digest")
        if (
            not isinstance(ref, str)
            or not isinstance(digest, str)
            or type(size) is not int
            or not 0 < size <= protocol.MAX_JOB_ARCHIVE_BYTES
        ):
            return self._refuse(
                user.name, "submit", f"a job archive of 1 to {protocol.MAX_JOB_ARCHIVE_BYTES} bytes is expected"
            )
        busy = self._start_submit(user.name)
        if busy:
            return self._refuse(user.name, "submit", busy)
        try:
            record = self._receive_job(user, message.source, ref, size, digest)
        finally:
            with self._lock:
                self._submitting[user.name] -= 1
                if not self._submitting[user.name]:
                    del self._submitting[user.name]
        self.daemon.audit.record(user.name, "submit", "ok", job=record.job_id, name=record.name)
        return reply_json(record.to_json())

    def _list(self, user: Participant, message: Message) -> Reply:
        denied = authorize(user, "list")
        if denied:
            return self._refuse(user.name, "list", denied)
        records = [r for r in self.daemon.store.list() if visible(user, r.submitter, r.submitter_org)]
        self.daemon.audit.record(user.name, "list", "ok")
        return reply_json([self._described(record) for record in records])

    def _status(self, user: Participant, message: Message) -> Reply:
        record, denied = self._job_for(user, message, "status")
        if denied:
            return denied
        self.daemon.audit.record(user.name, "status", "ok", job=record.job_id)
        return reply_json(self._described(record))

    def _abort(self, user: Participant, message: Message) -> Reply:
        record, denied = self._job_for(user, message, "abort")
        if denied:
            return denied
        if record.status not in ("SUBMITTED", "RUNNING"):
            return self._refuse(user.name, "abort", f"job {record.job_id} has ended already ({record.status})")
        record = self.daemon.abort_job(record.job_id, user.name, "abort command")
        self.daemon.audit.record(user.name, "abort", "ok", job=record.job_id)
        return reply_json(self._described(record))

    def _delete(self, user: Participant, message: Message) -> Reply:
        # authz has no "delete" action yet: deleting a job takes the right to abort it
        record, denied = self._job_for(user, message, "delete", rule="abort")
        if denied:
            return denied
        if not record.is_final:
            return self._refuse(
                user.name,
                "delete",
                f"job {record.job_id} is {record.status}; abort it first, or wait until it has ended",
                job=record.job_id,
            )
        self.daemon.store.delete(record.job_id)
        with self._lock:
            self._digests.pop(record.job_id, None)
            self._packing.pop(record.job_id, None)
        self.daemon.audit.record(user.name, "delete", "ok", job=record.job_id, name=record.name)
        return reply_json({"job_id": record.job_id, "deleted": True})

    def _download(self, user: Participant, message: Message) -> Reply:
        record, denied = self._job_for(user, message, "download")
        if denied:
            return denied
        if record.status in ("SUBMITTED", "RUNNING"):
            return self._refuse(
                user.name, "download", f"job {record.job_id} is {record.status}; download it once it ended"
            )
        deadline = time.monotonic() + protocol.RESULTS_WAIT_S
        while record.results_pending and time.monotonic() < deadline:  # the sites hand them in within seconds
            time.sleep(0.1)
            record = self.daemon.store.get(record.job_id)
        folder = self._new_offer(user.name)
        if folder is None:
            return self._refuse(
                user.name,
                "download",
                f"{user.name} has {MAX_DOWNLOADS_PER_ADMIN} downloads in progress already; busy, try again "
                f"once one has finished (an offer nobody pulls is dropped after {DOWNLOAD_TIMEOUT_S:g} s)",
                job=record.job_id,
            )
        try:
            try:
                archive, digest = self._results_of(record, folder / "results.zip")
            except JobArchiveError as e:  # the admin sees the job's folders, not where the server keeps them
                workspace = str(self.daemon.store.workspace(record.job_id))
                raise JobArchiveError(str(e).replace(workspace, f"job {record.job_id}")) from e
            size = archive.stat().st_size
            ref = self.daemon.endpoint.service.add_file(
                archive, protocol.ARCHIVE_CHUNK_BYTES, [message.source], DOWNLOAD_TIMEOUT_S, owned_folder=folder
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # frees the admin's offer slot too
            raise
        self.daemon.audit.record(user.name, "download", "ok", job=record.job_id, bytes=size)
        return reply_json({"ref": ref, "size": size, "digest": digest, "job_id": record.job_id})

    def _logs(self, user: Participant, message: Message) -> Reply:
        record, denied = self._job_for(user, message, "logs")
        if denied:
            return denied
        site = str(message.header.get("site") or self.daemon.kit.identity)
        if site != self.daemon.kit.identity and site not in record.sites:
            return self._refuse(
                user.name, "logs", f"job {record.job_id} did not run on {clip(site)!r}", job=record.job_id
            )
        offset = cursor_of(message.header)  # None: the last lines; else what follows, for `logs --follow`
        path = self.daemon.store.workspace(record.job_id) / site / LOG_FILE
        chunk = tail(path) if offset is None else read_from(path, offset)
        if offset is None:  # a follower's later polls are not audited, one line per second each
            self.daemon.audit.record(user.name, "logs", "ok", job=record.job_id, site=site)
        return reply_json(
            {
                "job_id": record.job_id,
                "site": site,
                "lines": chunk.lines,
                "offset": chunk.offset,
                "more": chunk.more,
                # read before the log: once true, every line of the log is in it (a site's comes with its results)
                "ended": record.is_final and site not in record.results_pending,
                "status": record.status,
                "reason": record.reason,
            }
        )

    def _watch(self, user: Participant, message: Message) -> Reply:
        # what `status` shows, as it changes: the right to see the job's status is the right to watch it
        record, denied = self._job_for(user, message, "watch", rule="status")
        if denied:
            return denied
        offset = cursor_of(message.header) or 0
        if offset == 0:  # a watcher's later polls are not audited, one line per second each
            self.daemon.audit.record(user.name, "watch", "ok", job=record.job_id)
        events = self.daemon.store.workspace(record.job_id) / self.daemon.kit.identity / EVENTS_FILE
        answer = watch_answer(self._described(record), events, offset, self.daemon.connected_sites())
        return reply_json(answer)

    def _clients(self, user: Participant, message: Message) -> Reply:
        denied = authorize(user, "clients")
        if denied:
            return self._refuse(user.name, "clients", denied)
        connected = self.daemon.connected_sites()
        running = self.daemon.running_jobs()
        sites = []
        for name, participant in sorted(self.daemon.participants.items()):
            if participant.kind != "site":
                continue
            jobs = sorted(job_id for job_id, job in running.items() if name in job.placement.sites)
            last = connected.get(name)
            sites.append(
                {
                    "site": name,
                    "org": participant.org,
                    "connected": last is not None,
                    "last_status_s": last,
                    "jobs": jobs,
                }
            )
        self.daemon.audit.record(user.name, "clients", "ok")
        return reply_json(sites)

    def _shutdown(self, user: Participant, message: Message) -> Reply:
        target = str(message.header.get("target", "server"))
        if target in ("server", "all"):
            denied = authorize(user, "shutdown")
        else:
            site = self.daemon.participants.get(target)
            if site is None or site.kind != "site":
                return self._refuse(user.name, "shutdown", f"{clip(target)!r} is not a site of this project")
            denied = authorize(user, "shutdown", target_site_org=site.org)
        if denied:
            return self._refuse(user.name, "shutdown", denied)
        self.daemon.audit.record(user.name, "shutdown", "ok", target=target)
        sites = [target] if target not in ("server", "all") else []
        if target == "all":
            sites = sorted(self.daemon.connected_sites())
        for site in sites:
            try:
                self.daemon.endpoint.cell.send(site, protocol.SITE_CHANNEL, protocol.TOPIC_SHUTDOWN, {"by": user.name})
            except Exception as e:  # a site that is gone is already down
                log.warning("shutdown not sent to %s: %s", site, clip(e))
        if target in ("server", "all"):
            # after this reply has gone out: the admin sees the answer, then the server stops
            threading.Timer(0.5, self.daemon.stop, args=(f"shutdown by {user.name}",)).start()
        return reply_json({"shutdown": target})

    # ----------------------------------------------------------------- helpers

    def _start_submit(self, admin: str) -> str | None:
        """Count a submit of ``admin`` as in progress; None, or why it is refused (busy, or over its quota)."""
        with self._lock:
            running = self._submitting.get(admin, 0)
            if running >= MAX_SUBMITS_PER_ADMIN:
                return f"{admin} has {running} submits in progress already; busy, try again once one has finished"
            waiting = sum(1 for record in self.daemon.store.queued() if record.submitter == admin) + running
            if waiting >= MAX_QUEUED_JOBS:
                return (
                    f"you have {waiting} jobs waiting, the most an admin may have ({MAX_QUEUED_JOBS}); "
                    "abort one or wait until one has started"
                )
            self._submitting[admin] = running + 1
        return None

    def _receive_job(self, user: Participant, source: str, ref: str, size: int, digest: str) -> JobRecord:
        """Pull the job archive ``ref`` of ``size`` bytes from the admin's cell and store the job."""
        folder = Path(tempfile.mkdtemp(prefix="submit-", dir=self.daemon.workspace))
        try:
            what = f"the job archive of {user.name}"
            archive = pull_archive(self.daemon.endpoint.cell, source, ref, folder / "job.zip", size, digest, what)
            return self.daemon.store.submit(archive, user.name, user.org, accept=lambda job: _byoc_refusal(user, job))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _new_offer(self, admin: str) -> Path | None:
        """A fresh folder for a download offer of ``admin``; None when it has its most offers out already.

        The download service deletes an offer's folder when the offer is done or dropped, so the
        folders that still exist are the offers still out.
        """
        with self._lock:
            offers = [folder for folder in self._offers.get(admin, []) if folder.exists()]
            if len(offers) >= MAX_DOWNLOADS_PER_ADMIN:
                self._offers[admin] = offers
                return None
            folder = Path(tempfile.mkdtemp(prefix="download-", dir=self.daemon.workspace))
            self._offers[admin] = [*offers, folder]
        return folder

    def _results_of(self, record: JobRecord, served: Path) -> tuple[Path, str]:
        """The job's workspace packed at ``served``, and its digest.

        Once no more results can come (`results_settled`), the workspace is packed once into
        ``<job>/results.zip`` and ``served`` is a hard link to it; until then it is packed afresh.
        Each packing writes the job's ``summary.json`` first (`ServerDaemon.write_summary`).
        """
        workspace = self.daemon.store.workspace(record.job_id)
        if not results_settled(record, workspace):
            self.daemon.write_summary(record.job_id)  # what is known now: results may still come in
            pack_job(workspace, served, max_files=protocol.RESULTS_MAX_FILES, max_bytes=protocol.RESULTS_MAX_BYTES)
            return served, archive_digest(served)
        kept = self.daemon.store.results_archive(record.job_id)
        with self._lock:
            packing = self._packing.setdefault(record.job_id, threading.Lock())
        with packing:  # concurrent downloads of one job pack it once
            if not kept.exists():
                self.daemon.write_summary(record.job_id)  # the last word: no more results come
                pack_job(workspace, served, max_files=protocol.RESULTS_MAX_FILES, max_bytes=protocol.RESULTS_MAX_BYTES)
                _link(served, kept)
            else:
                _link(kept, served)
            with self._lock:
                digest = self._digests.get(record.job_id)
            if digest is None:  # once per job and server run
                digest = archive_digest(kept)
                with self._lock:
                    self._digests[record.job_id] = digest
        return served, digest

    def _job_for(
        self, user: Participant, message: Message, action: str, rule: str | None = None
    ) -> tuple[JobRecord, Reply | None]:
        """The job the message names, and a refusal unless ``user`` may take ``rule`` (default ``action``) on it."""
        job_id = str(message.header.get("job_id", ""))
        record = self.daemon.store.get(job_id)  # a bad or unknown id raises JobStoreError: the reply
        if not visible(user, record.submitter, record.submitter_org):
            # answered as an id that does not exist, so that no answer tells that another org's job exists
            hidden = f"the job is not visible to {user.role} {user.name}"
            return record, self._refuse(user.name, action, hidden, job=job_id, answer=unknown_job(job_id))
        denied = authorize(user, rule or action, job_submitter=record.submitter, job_org=record.submitter_org)
        if denied:
            if rule:
                denied = f"{action} needs the right to {rule} the job: {denied}"
            return record, self._refuse(user.name, action, denied, job=job_id)
        return record, None

    def _described(self, record: JobRecord) -> dict[str, Any]:
        described = record.to_json()
        if record.status == "SUBMITTED":
            described["waiting"] = self.daemon.waiting_reason(record.job_id) or "waiting for the scheduler"
        return described

    def _refuse(self, actor: str, command: str, reason: str, *, answer: str | None = None, **details: Any) -> Reply:
        """Audit and log a refusal for ``reason``; the admin reads ``answer`` (default: the reason)."""
        self.daemon.audit.record(actor, command or "?", "refused", reason=reason, **details)
        REFUSALS.warning(log, "admin command refused: %s by %s: %s", clip(command), clip(actor), clip(reason))
        return Reply(status=Status.ERROR, reason=reason if answer is None else answer)


def unknown_job(job_id: str) -> str:
    """What an admin reads for a job id that names no job, or a job they may not see: the job store's words."""
    return f"no job {job_id}"


def _link(source: Path, dest: Path) -> None:
    """Make ``dest`` the same file as ``source``: a hard link, or a copy where none can be made; atomically."""
    partial = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        try:
            os.link(source, partial)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(source, partial)
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _byoc_refusal(user: Participant, job: Job) -> str | None:
    """Why ``user`` may not submit ``job``: it brings its own code and the user's role may not (byoc)."""
    code = job_code_of(job)
    if not code:
        return None
    denied = authorize(user, "byoc")
    if denied is None:
        return None
    listed = "; ".join(code[:3]) + (f" and {len(code) - 3} more" if len(code) > 3 else "")
    return f"the job brings its own code ({listed}): {denied}"


def reply_json(data: Any, status: Status = Status.OK, reason: str = "") -> Reply:
    """A reply carrying ``data`` as one JSON body frame (what every admin command answers)."""
    return Reply(frames=[json.dumps(data, default=str).encode("utf-8")], status=status, reason=reason)
