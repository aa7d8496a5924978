"""`ClientDaemon`: the long-running client of a site (``flengine client start KIT``).

It connects out to the server (and reconnects whenever the server goes away and comes back),
tells it every few seconds that it is alive and which jobs it runs, and waits for deployments.
For each job the server deploys, the site's own policy (``policy.conf`` in its kit, which the
site and not the server controls) decides whether it runs it; a refusal goes back with the
reason. An accepted job's archive is downloaded, checked against its digest and unpacked safely
into ``<workspace>/<job id>/job``; once every site of the job accepted it, the server says start
and the job runs in a job process of its own (the same runtime the simulator uses), which
connects to the job's port on the server and knows the job's sites (``--clients``, from the
deployment) for the Client API's ``get_site_index``. A job another site refused is dropped unrun.
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


def is_job_site_list(sites: object, identity: str) -> bool:
    """Whether a deployment's ``sites`` is a list of the job's client sites that this site can run with.

    Distinct names, none empty, with a comma or starting with ``-`` (they go on the job process's
    command line as ``--clients A,B``), at most `protocol.MAX_JOB_SITES` of them, ``identity`` (this
    site) among them.
    """
    return (
        isinstance(sites, list)
        and 0 < len(sites) <= protocol.MAX_JOB_SITES
        and all(isinstance(site, str) and site and "," not in site and site[0] != "-" for site in sites)
        and len(set(sites)) == len(sites)
        and identity in sites
    )


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
        self._stopping = threading.Lock()  # one `stop` at a time
        self._jobs: dict[str, JobProcess] = {}
        self._prepared: dict[str, list[str]] = {}  # job id -> its process's args, until the server says start
        self._aborted: collections.deque[str] = collections.deque(maxlen=1024)  # aborted before they arrived
        self._args: dict[str, list[str]] = {}  # job id -> its process's args, once started (to start it again)
        self._restarts: collections.Counter[str] = collections.Counter()  # crashed processes started again
        self._replaced: set[int] = set()  # pids of processes stopped to be replaced: their end is no job end
        self._stopped_jobs: set[str] = set()  # jobs the server stopped: their processes are not started again
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
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_RESUME, self._on_resume)
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
        """Stop every job process of this site, then the cell (safe to call twice, from two threads at once)."""
        with self._stopping:
            self.stopped.set()
            with self._lock:
                jobs = list(self._jobs.items())
            for job_id, process in jobs:
                log.info("stopping job %s: %s", job_id, reason)
                process.stop()
            if self._status_thread is not None and self._status_thread is not threading.current_thread():
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
        sites = header.get("sites")
        if (
            len(job_id) != 12
            or not set(job_id) <= _JOB_ID_CHARS
            or type(port) is not int
            or not 0 < port < 65536
            or type(size) is not int
            or not 0 < size <= protocol.MAX_JOB_ARCHIVE_BYTES
            or not isinstance(ref, str)
            or not isinstance(digest, str)
            or not is_job_site_list(sites, self.kit.identity)
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
        args = self._job_args(job_id, job_dir, port, sites)
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
            self._start_locked(job_id, args)
        self.audit.record(self.kit.identity, "job_start", "ok", job=job_id)
        return Reply()

    def _job_args(self, job_id: str, job_dir: Path, port: int, sites: list[str]) -> list[str]:
        """The arguments of a job process of this site (``python -m engine.runtime.entry ...``)."""
        return [
            "client",
            "--job", str(job_dir),
            "--workspace", str(self.workspace / job_id / "workspace"),
            "--site", self.kit.identity,
            "--job-id", job_id,
            "--connect", f"tcp://{self.kit.server.host}:{port}",
            "--clients", ",".join(sites),
            "--keys", str(self.kit.keys_dir),
        ]  # fmt: skip

    def _start_locked(self, job_id: str, args: list[str]) -> None:
        """Start the job's process (under the lock); its end calls `_ended`."""
        folder = self.workspace / job_id / "workspace" / self.kit.identity
        holder: list[JobProcess] = []
        process = JobProcess(args, folder, lambda code: self._ended(job_id, code, holder[0].pid))
        holder.append(process)
        self._jobs[job_id] = process
        self._args[job_id] = args

    def _on_resume(self, message: Message) -> Reply:
        """The server restarted and resumes a job this site ran: start its process again (a new one)."""
        if not self._from_server(message):
            return Reply(header={"resumed": False, "reason": "jobs are resumed by the server only"})
        header = message.header
        job_id, port, sites = str(header.get("job_id", "")), header.get("port"), header.get("sites")
        job_dir = self.workspace / job_id / "job"
        if (
            len(job_id) != 12
            or not set(job_id) <= _JOB_ID_CHARS
            or type(port) is not int
            or not 0 < port < 65536
            or not is_job_site_list(sites, self.kit.identity)
        ):
            return Reply(header={"resumed": False, "reason": "a malformed resume"})
        if not job_dir.is_dir():
            return Reply(header={"resumed": False, "reason": f"job {job_id} never ran here"})
        with self._lock:
            old = self._jobs.get(job_id)
            if old is not None and old.running:
                self._replaced.add(old.pid)
        if old is not None and old.running:
            old.stop()  # it lost its server: a fresh process connects to the resumed job
        with self._lock:
            if self.stopped.is_set():
                return Reply(header={"resumed": False, "reason": "the site is stopping"})
            self._restarts.pop(job_id, None)
            self._stopped_jobs.discard(job_id)
            self._start_locked(job_id, self._job_args(job_id, job_dir, port, list(sites)))
        self.audit.record(self.kit.identity, "job_resume", "ok", job=job_id)
        log.info("job %s started again: the server resumes it", job_id)
        return Reply(header={"resumed": True})

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
            self._stopped_jobs.add(job_id)  # its process is not started again when it ends
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

    def _ended(self, job_id: str, code: int, pid: int = 0) -> None:
        """The job process ended: start a crashed one again, or audit the end, tell the server, offer the results."""
        with self._lock:
            if pid in self._replaced:  # stopped by `_on_resume`: a new process runs the job
                self._replaced.discard(pid)
                return
            restart = (
                code != 0
                and not self.stopped.is_set()
                and job_id not in self._stopped_jobs
                and self._restarts[job_id] < protocol.MAX_JOB_RESTARTS
            )
            if restart:
                self._restarts[job_id] += 1
        if restart:
            self._restart_later(job_id, code)
            return
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

    def _restart_later(self, job_id: str, code: int) -> None:
        """A job process crashed while its job runs: tell the server (it leaves the site out), start it again."""
        count = self._restarts[job_id]
        self.audit.record(self.kit.identity, "job_restart", "ok", job=job_id, code=code, restart=count)
        log.warning("job %s: its process exited with %d; starting it again (%d of %d)", job_id, code, count,
                    protocol.MAX_JOB_RESTARTS)  # fmt: skip
        try:
            header = {"job_id": job_id, "code": code}
            self.endpoint.cell.send(
                self.kit.server.name, protocol.SITE_CHANNEL, protocol.TOPIC_JOB_PROCESS_EXITED, header
            )
        except (CellError, RuntimeError) as e:
            log.warning("crash of job %s not reported: %s", job_id, e)

        def start_again() -> None:
            with self._lock:
                process, args = self._jobs.get(job_id), self._args.get(job_id)
                if self.stopped.is_set() or job_id in self._stopped_jobs or args is None:
                    return
                if process is None or not process.running:
                    self._start_locked(job_id, args)

        timer = threading.Timer(protocol.JOB_RESTART_DELAY_S, start_again)
        timer.daemon = True
        timer.start()

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
