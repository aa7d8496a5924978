"""`ClientDaemon`: the long-running client of a site (``flengine client start KIT``).

It connects out to the server (and reconnects whenever the server goes away and comes back),
tells it every few seconds that it is alive and which jobs it runs, and waits for deployments.
For each job the server deploys, the site's own policy (``policy.conf`` in its kit, which the
site and not the server controls) decides whether it runs it; a refusal goes back with the
reason. An accepted job's archive is downloaded, checked against its digest and unpacked safely
into ``<workspace>/<job id>/job``; once every site of the job accepted it, the server says start
and the job runs in a job process of its own (the same runtime the simulator uses), which
connects to the job's port on the server. A job another site refused is dropped unrun.
"""

from __future__ import annotations

import collections
import logging
import shutil
import threading
from pathlib import Path

from engine.cells import Message, Reply, Status
from engine.config import job_code_of, load_job
from engine.deploy import protocol
from engine.deploy.archive import unpack_job
from engine.deploy.audit import AuditLog
from engine.deploy.folders import private_folder
from engine.deploy.job_process import JobProcess
from engine.deploy.results import offer_results
from engine.deploy.transfer import pull_archive
from engine.errors import CellError, FlengineError, UsageError
from engine.provision import Kit
from engine.provision.policy import POLICY_FILE, SitePolicy, load_site_policy
from engine.site import SiteEndpoint, SiteSettings

log = logging.getLogger(__name__)

_JOB_ID_CHARS = frozenset("0123456789abcdef")


class ClientDaemon:
    """The client of one site in a deployed project.

    Args:
        kit: The site's startup kit (already verified by `engine.provision.load_kit`).
        workspace: Where jobs are unpacked and run, and the audit log lives (created 0700).
    """

    def __init__(self, kit: Kit, workspace: Path) -> None:
        if kit.participant.kind != "site":
            raise UsageError(f"{kit.folder}: the kit of {kit.identity!r} is a {kit.participant.kind} kit, not a site's")
        self.kit = kit
        self.workspace = private_folder(Path(workspace).resolve())
        self.policy: SitePolicy = load_site_policy(kit.folder / POLICY_FILE)
        self.audit = AuditLog(self.workspace / "audit.log")
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._jobs: dict[str, JobProcess] = {}
        self._prepared: dict[str, list[str]] = {}  # job id -> its process's args, until the server says start
        self._aborted: collections.deque[str] = collections.deque(maxlen=1024)  # aborted before they arrived
        self._endpoint: SiteEndpoint | None = None
        self._status_thread: threading.Thread | None = None
        self._status_sent = False

    def start(self) -> ClientDaemon:
        """Open the cell (it connects and reconnects by itself) and start reporting status."""
        settings = SiteSettings(self.kit.identity, self.kit.cell_settings(), self.kit.keys_dir)
        endpoint = SiteEndpoint.for_site(
            settings, {}, connect_to=self.kit.server.connect_address, workspace=self.workspace
        )
        self._endpoint = endpoint.start()
        cell = endpoint.cell
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_DEPLOY, self._on_deploy)
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_START, self._on_start)
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_ABORT, self._on_abort)
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_SHUTDOWN, self._on_shutdown)
        self._status_thread = threading.Thread(target=self._report_status, name="client-status", daemon=True)
        self._status_thread.start()
        self.audit.record(self.kit.identity, "start", "ok", server=self.kit.server.connect_address)
        log.info("client started: site=%s server=%s", self.kit.identity, self.kit.server.connect_address)
        return self

    @property
    def endpoint(self) -> SiteEndpoint:
        """The site's endpoint (after `start`)."""
        if self._endpoint is None:
            raise RuntimeError("the client daemon is not started")
        return self._endpoint

    def serve(self) -> None:
        """Block until `stop` is called (a signal handler, or the server's ``shutdown``)."""
        self.stopped.wait()

    def stop(self, reason: str = "the client stopped") -> None:
        """Stop every job process of this site, then the cell (safe to call twice)."""
        self.stopped.set()
        with self._lock:
            jobs = list(self._jobs.items())
        for job_id, process in jobs:
            log.info("stopping job %s: %s", job_id, reason)
            process.stop()
        if self._status_thread is not None:
            self._status_thread.join(5.0)
        if self._endpoint is not None:
            self.audit.record(self.kit.identity, "stop", "ok", reason=reason)
            self._endpoint.close()
            self._endpoint = None

    def running_jobs(self) -> list[str]:
        """Ids of the jobs whose process runs on this site."""
        with self._lock:
            return sorted(job_id for job_id, process in self._jobs.items() if process.running)

    # ----------------------------------------------------------------- handlers

    def _from_server(self, message: Message) -> bool:
        return message.source == self.kit.server.name

    def _on_deploy(self, message: Message) -> Reply:
        if not self._from_server(message):
            return Reply(header={"accepted": False, "reason": "deployments come from the server only"})
        header = message.header
        job_id = str(header.get("job_id", ""))
        submitter, org = str(header.get("submitter", "")), str(header.get("org", ""))
        port, size, ref, digest = header.get("port"), header.get("size"), header.get("ref"), header.get("digest")
        if (
            len(job_id) != 12
            or not set(job_id) <= _JOB_ID_CHARS
            or type(port) is not int
            or not 0 < port < 65536
            or type(size) is not int
            or not 0 < size <= protocol.MAX_JOB_ARCHIVE_BYTES
            or not isinstance(ref, str)
            or not isinstance(digest, str)
        ):
            return self._refuse(job_id, submitter, "a malformed deployment")
        refusal = self.policy.refusal(submitter, org, has_custom_code=False)
        if refusal:
            return self._refuse(job_id, submitter, refusal)
        with self._lock:
            if job_id in self._jobs or job_id in self._prepared:
                return self._refuse(job_id, submitter, "this job was deployed here already")
        folder = self.workspace / job_id
        try:
            job_dir = self._fetch(folder, ref, size, digest)
            job = load_job(job_dir, build=False, environment=False)  # checked here without running any of it
            refusal = self.policy.refusal(submitter, org, has_custom_code=bool(job_code_of(job)))
            if refusal:
                shutil.rmtree(folder, ignore_errors=True)
                return self._refuse(job_id, submitter, refusal)
        except (FlengineError, OSError) as e:
            shutil.rmtree(folder, ignore_errors=True)
            return self._refuse(job_id, submitter, f"the job could not be prepared: {e}")
        host = self.kit.server.host
        args = [
            "client",
            "--job", str(job_dir),
            "--workspace", str(folder / "workspace"),
            "--site", self.kit.identity,
            "--job-id", job_id,
            "--connect", f"tcp://{host}:{port}",
            "--keys", str(self.kit.keys_dir),
        ]  # fmt: skip
        with self._lock:
            aborted = job_id in self._aborted  # the server gave up on it while it downloaded
            if not aborted:
                self._prepared[job_id] = args
        if aborted:
            shutil.rmtree(folder, ignore_errors=True)
            return self._refuse(job_id, submitter, "the job was aborted while it was prepared")
        self.audit.record(self.kit.identity, "job_deploy", "accepted", job=job_id, submitter=submitter, org=org)
        return Reply(header={"accepted": True})

    def _on_start(self, message: Message) -> Reply:
        """Every site accepted the job: start its process here."""
        if not self._from_server(message):
            return Reply(status=Status.ERROR, reason="jobs are started by the server only")
        job_id = str(message.header.get("job_id", ""))
        with self._lock:
            args = self._prepared.pop(job_id, None)
            if args is None:
                return Reply(status=Status.ERROR, reason=f"no prepared job {job_id!r} here")
            folder = self.workspace / job_id / "workspace" / self.kit.identity
            self._jobs[job_id] = JobProcess(args, folder, lambda code: self._ended(job_id, code))
        self.audit.record(self.kit.identity, "job_start", "ok", job=job_id)
        return Reply()

    def _fetch(self, folder: Path, ref: str, size: int, digest: str) -> Path:
        """Download the job archive, check its digest, unpack it; return the job folder."""
        folder.mkdir(mode=0o700)
        archive = pull_archive(
            self.endpoint.cell, self.kit.server.name, ref, folder / "job.zip", size, digest, "the job archive"
        )
        return unpack_job(archive, folder / "job")

    def _on_abort(self, message: Message) -> Reply:
        if not self._from_server(message):
            return Reply(header={"stopped": False})
        job_id = str(message.header.get("job_id", ""))
        with self._lock:
            process = self._jobs.get(job_id)
            dropped = self._prepared.pop(job_id, None) is not None
            if process is None and not dropped:  # a deployment may still be on its way: it must not start
                self._aborted.append(job_id)
        if dropped:  # refused by another site: it never ran here, nothing of it stays
            shutil.rmtree(self.workspace / job_id, ignore_errors=True)
            self.audit.record(self.kit.identity, "job_drop", "ok", job=job_id)
        if process is not None and process.running:
            log.info("job %s stopped: %s", job_id, str(message.header.get("reason", ""))[:200])
            threading.Thread(target=process.stop, name=f"stop-{job_id}", daemon=True).start()
        return Reply(header={"stopped": process is not None or dropped})

    def _on_shutdown(self, message: Message) -> None:
        if self._from_server(message):
            by = str(message.header.get("by", ""))[:100]
            threading.Thread(target=self.stop, args=(f"shutdown by {by}",), daemon=True).start()
        return None

    def _ended(self, job_id: str, code: int) -> None:
        """The job process ended: audit it, tell the server, and offer it this site's results."""
        self.audit.record(self.kit.identity, "job_end", "ok" if code == 0 else "failed", job=job_id, code=code)
        if self.stopped.is_set():
            return
        try:
            folder = self.workspace / job_id / "workspace" / self.kit.identity
            results = offer_results(self.endpoint, folder, self.kit.server.name)
            header = {"job_id": job_id, "code": code, **results}
            self.endpoint.cell.send(self.kit.server.name, protocol.SITE_CHANNEL, protocol.TOPIC_JOB_ENDED, header)
        except (CellError, RuntimeError) as e:
            log.warning("job end of %s not reported: %s", job_id, e)

    def _refuse(self, job_id: str, submitter: str, reason: str) -> Reply:
        self.audit.record(self.kit.identity, "job_deploy", "refused", job=job_id, submitter=submitter, reason=reason)
        log.warning("job %s of %s refused: %s", job_id, submitter, reason)
        return Reply(header={"accepted": False, "reason": reason})

    def _report_status(self) -> None:
        while not self.stopped.wait(protocol.STATUS_INTERVAL_S if self._status_sent else 0.2):
            try:
                self.endpoint.cell.send(
                    self.kit.server.name, protocol.SITE_CHANNEL, protocol.TOPIC_STATUS, {"running": self.running_jobs()}
                )
                self._status_sent = True
            except (CellError, RuntimeError) as e:  # not connected yet, or the server is away
                log.debug("status not sent: %s", e)
