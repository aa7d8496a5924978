"""`AdminCommands`: what the server daemon answers to admin sessions, each authorized and audited.

One request per command on ``admin/command``, header ``command`` plus its args; the answer is
one JSON body frame (`reply_json`), or an error reply whose reason the admin tool prints. The
admin is the identity of the session's key (its cell is ``alice.<token>``), its role and org
come from the server kit's ``participants.json``; `engine.deploy.authz` decides, and every
command, allowed or not, is a line of the audit log.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.cells import Message, Reply, Status
from engine.deploy import protocol
from engine.deploy.archive import archive_digest, pack_job
from engine.deploy.authz import authorize, visible
from engine.deploy.job_store import JobRecord
from engine.deploy.server import ServerDaemon, reply_json
from engine.errors import FlengineError
from engine.provision.project import Participant
from engine.streaming.service import ByteBudget, download_file

log = logging.getLogger(__name__)

#: Lines of a log that ``logs`` returns at most (the end of the file).
LOG_LINES = 200


class AdminCommands:
    """The admin command handlers of a `ServerDaemon`."""

    def __init__(self, daemon: ServerDaemon) -> None:
        self.daemon = daemon
        self._commands: dict[str, Callable[[Participant, Message], Reply]] = {
            "submit": self._submit,
            "list": self._list,
            "status": self._status,
            "abort": self._abort,
            "download": self._download,
            "logs": self._logs,
            "clients": self._clients,
            "shutdown": self._shutdown,
        }

    def handle(self, message: Message) -> Reply:
        """Authorize and run one command; never raises (an error is the reply)."""
        identity = message.source.split(".", 1)[0]
        command = str(message.header.get("command", ""))
        user = self.daemon.participants.get(identity)
        if user is None or user.kind != "admin":
            return self._refuse(identity, command, f"{identity} is not an admin of this project")
        handler = self._commands.get(command)
        if handler is None:
            return self._refuse(identity, command, f"unknown command {command!r}; known: {', '.join(self._commands)}")
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
        ref, size = message.header.get("ref"), message.header.get("size")
        if not isinstance(ref, str) or type(size) is not int or not 0 < size <= protocol.MAX_JOB_ARCHIVE_BYTES:
            return self._refuse(
                user.name, "submit", f"a job archive of 1 to {protocol.MAX_JOB_ARCHIVE_BYTES} bytes is expected"
            )
        folder = Path(tempfile.mkdtemp(prefix="submit-", dir=self.daemon.workspace))
        try:
            archive = download_file(
                self.daemon.endpoint.cell,
                message.source,
                ref,
                folder / "job.zip",
                per_request_timeout_s=60.0,
                budget=ByteBudget(size, f"the job archive of {user.name}"),
                min_throughput=64 << 10,
            )
            record = self.daemon.store.submit(archive, user.name, user.org)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
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

    def _download(self, user: Participant, message: Message) -> Reply:
        record, denied = self._job_for(user, message, "download")
        if denied:
            return denied
        if record.status in ("SUBMITTED", "RUNNING"):
            return self._refuse(
                user.name, "download", f"job {record.job_id} is {record.status}; download it once it ended"
            )
        folder = Path(tempfile.mkdtemp(prefix="download-", dir=self.daemon.workspace))
        try:
            archive = pack_job(self.daemon.store.workspace(record.job_id), folder / "results.zip")
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        size, digest = archive.stat().st_size, archive_digest(archive)
        ref = self.daemon.endpoint.service.add_file(
            archive, protocol.ARCHIVE_CHUNK_BYTES, [message.source], 300.0, owned_folder=folder
        )
        self.daemon.audit.record(user.name, "download", "ok", job=record.job_id, bytes=size)
        return reply_json({"ref": ref, "size": size, "digest": digest, "job_id": record.job_id})

    def _logs(self, user: Participant, message: Message) -> Reply:
        record, denied = self._job_for(user, message, "logs")
        if denied:
            return denied
        site = str(message.header.get("site") or self.daemon.kit.identity)
        if site != self.daemon.kit.identity and site not in record.sites:
            return self._refuse(user.name, "logs", f"job {record.job_id} did not run on {site!r}", job=record.job_id)
        path = self.daemon.store.workspace(record.job_id) / site / "log.txt"
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()[-LOG_LINES:]
        except OSError:
            lines = []
        self.daemon.audit.record(user.name, "logs", "ok", job=record.job_id, site=site)
        return reply_json({"job_id": record.job_id, "site": site, "lines": lines})

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
                return self._refuse(user.name, "shutdown", f"{target!r} is not a site of this project")
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
                log.warning("shutdown not sent to %s: %s", site, e)
        if target in ("server", "all"):
            # after this reply has gone out: the admin sees the answer, then the server stops
            threading.Timer(0.5, self.daemon.stop, args=(f"shutdown by {user.name}",)).start()
        return reply_json({"shutdown": target})

    # ----------------------------------------------------------------- helpers

    def _job_for(self, user: Participant, message: Message, action: str) -> tuple[JobRecord, Reply | None]:
        job_id = str(message.header.get("job_id", ""))
        record = self.daemon.store.get(job_id)  # a bad or unknown id raises JobStoreError: the reply
        denied = authorize(user, action, job_submitter=record.submitter, job_org=record.submitter_org)
        if denied:
            return record, self._refuse(user.name, action, denied, job=job_id)
        return record, None

    def _described(self, record: JobRecord) -> dict[str, Any]:
        described = record.to_json()
        if record.status == "SUBMITTED":
            described["waiting"] = self.daemon.waiting_reason(record.job_id) or "waiting for the scheduler"
        return described

    def _refuse(self, actor: str, command: str, reason: str, **details: Any) -> Reply:
        self.daemon.audit.record(actor, command or "?", "refused", reason=reason, **details)
        log.warning("admin command refused: %s by %s: %s", command, actor, reason)
        return Reply(status=Status.ERROR, reason=reason)
