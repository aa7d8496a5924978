"""`ServerDaemon`: the long-running server of production mode (``flengine server start KIT``).

It runs until stopped (SIGTERM, Ctrl-C or an admin's ``shutdown``) and:

- accepts the project's sites and admins on the kit's port (CURVE, the kit's allowlist; a
  sender's identity comes from its key),
- keeps the **job store** (``<workspace>/jobs``): every submitted job's archive, folder, record
  and server workspace; it survives a restart (a job that was running when the server stopped
  is recorded FINISHED_ABORTED),
- **schedules** submitted jobs in order (`engine.deploy.scheduler`): when a job's sites are
  connected and its resources fit, the job archive is offered to each site, each site checks
  it against its own policy and starts its job process, and the job's server process starts on
  one of the job ports (``port + 1`` on), the same runtime `flengine run` uses,
- answers admin commands (`engine.deploy.commands`), each authorized by the admin's role and
  written to the audit log (``<workspace>/audit.log``),
- picks up a re-provisioned server kit without a restart: when the kit's ``MANIFEST.json``
  changes, the kit is verified again and its allowlist and participants replace the old ones
  (a participant that left is cut off at its next message; a kit that fails the check is logged
  and the old settings stay).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cells import Message, Reply, Status
from engine.cells.log_limit import REFUSALS
from engine.config import load_job
from engine.deploy import protocol
from engine.deploy.audit import AuditLog, clip
from engine.deploy.authz import load_participants
from engine.deploy.folders import private_folder
from engine.deploy.job_process import JobProcess
from engine.deploy.job_store import JobRecord, JobStore, utc_now
from engine.deploy.results import take_results
from engine.deploy.scheduler import Impossible, Placement, SiteState, place
from engine.errors import CellError, FlengineError, UsageError
from engine.provision import MANIFEST_FILE, Kit, load_kit
from engine.provision.kit import PARTICIPANTS_FILE
from engine.runtime.states import JobState
from engine.security import ALLOWLIST_FOLDER, load_allowlist
from engine.site import SiteEndpoint, SiteSettings

log = logging.getLogger(__name__)

#: Seconds between two looks of the scheduler at the queue.
SCHEDULE_INTERVAL_S = 1.0
#: Seconds the end of a job waits for its sites' job processes to end and hand in their results.
RESULTS_WAIT_S = 30.0
#: The job process's outcome file, in its site folder of the job workspace.
RESULT_FILE = "result.json"
REJECTED = "FINISHED_REJECTED"


@dataclass
class RunningJob:
    """A job whose server process runs: where, on which port, what it takes of each site."""

    record: JobRecord
    placement: Placement
    port: int
    process: JobProcess | None = None
    aborted_by: str = ""
    ended_sites: set[str] = dataclasses.field(default_factory=set)  # job process ended, results taken
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)  # its record is final


class ServerDaemon:
    """The server of a deployed project.

    Args:
        kit: The server's startup kit (already verified by `engine.provision.load_kit`).
        workspace: Where the job store and the audit log live (created 0700).
        job_ports: The ports job processes bind, one per running job; ``port + 1`` to
            ``port + 10`` of the kit by default.
    """

    def __init__(self, kit: Kit, workspace: Path, job_ports: Sequence[int] | None = None) -> None:
        if kit.participant.kind != "server":
            raise UsageError(
                f"{kit.folder}: the kit of {kit.identity!r} is a {kit.participant.kind} kit, not the server's"
            )
        self.kit = kit
        self.workspace = private_folder(Path(workspace).resolve())
        first = kit.server.port + 1
        self._free_ports = collections.deque(job_ports or range(first, first + protocol.DEFAULT_JOB_PORTS))
        self.participants = load_participants(kit.folder / PARTICIPANTS_FILE)
        self.store = JobStore(self.workspace / "jobs")
        self.audit = AuditLog(self.workspace / "audit.log")
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # site -> last status, monotonic
        self._running: dict[str, RunningJob] = {}
        self._waiting: dict[str, str] = {}  # job id -> why it waits
        self._endpoint: SiteEndpoint | None = None
        self._threads: list[threading.Thread] = []
        self._kit_stamp = _stamp(kit.folder / MANIFEST_FILE)
        self._kit_failed: tuple[int, int, int] | None = None

    # ----------------------------------------------------------------- life

    def start(self) -> ServerDaemon:
        """Recover the job store, open the cell, start the scheduler."""
        from engine.deploy.commands import AdminCommands  # the commands use this daemon

        for record in self.store.recover():
            self.audit.record("server", "job_end", record.status, job=record.job_id, reason=record.reason)
        settings = SiteSettings(self.kit.identity, self.kit.cell_settings(), self.kit.keys_dir)
        self._endpoint = SiteEndpoint.for_site(settings, {}, workspace=self.workspace).start()
        cell = self._endpoint.cell
        commands = AdminCommands(self)
        cell.register_handler(protocol.ADMIN_CHANNEL, protocol.TOPIC_COMMAND, commands.handle)
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_STATUS, self._on_site_status)
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_JOB_ENDED, self._on_job_ended)
        self._spawn(self._schedule_loop, "scheduler")
        self._spawn(self._reload_loop, "reload")
        self.audit.record("server", "start", "ok", endpoint=cell.endpoint)
        log.info("server started: project=%s endpoint=%s workspace=%s", self.kit.project, cell.endpoint, self.workspace)
        return self

    @property
    def endpoint(self) -> SiteEndpoint:
        """The server's endpoint (after `start`)."""
        if self._endpoint is None:
            raise RuntimeError("the server daemon is not started")
        return self._endpoint

    def serve(self) -> None:
        """Block until `stop` (a signal handler, or an admin's ``shutdown``) is called."""
        self.stopped.wait()

    def stop(self, reason: str = "the server stopped") -> None:
        """Abort every running job, close the cell (safe to call twice)."""
        if self._endpoint is None:
            return
        self.stopped.set()
        with self._lock:
            running = list(self._running.values())
        for job in running:
            self.abort_job(job.record.job_id, "server", reason)
        for thread in self._threads:
            thread.join(5.0)
        self.audit.record("server", "stop", "ok", reason=reason)
        self._endpoint.close()
        self._endpoint = None
        log.info("server stopped: %s", reason)

    # ----------------------------------------------------------------- sites

    def connected_sites(self) -> dict[str, float]:
        """Sites heard from within `protocol.STATUS_TIMEOUT_S`: name -> seconds since their last status."""
        now = time.monotonic()
        with self._lock:
            return {site: now - seen for site, seen in self._seen.items() if now - seen <= protocol.STATUS_TIMEOUT_S}

    def running_jobs(self) -> dict[str, RunningJob]:
        """The jobs whose server process runs, by id."""
        with self._lock:
            return dict(self._running)

    def waiting_reason(self, job_id: str) -> str | None:
        """Why a submitted job has not started yet (None if the scheduler has not looked at it)."""
        with self._lock:
            return self._waiting.get(job_id)

    def _on_site_status(self, message: Message) -> None:
        site = message.source.split(".", 1)[0]
        participant = self.participants.get(site)
        if participant is None or participant.kind != "site" or message.source != site:
            REFUSALS.warning(log, "site status refused: %s is not a site of this project", message.source)
            return None
        with self._lock:
            first = site not in self._seen or time.monotonic() - self._seen[site] > protocol.STATUS_TIMEOUT_S
            self._seen[site] = time.monotonic()
        if first:
            log.info("site connected: %s", site)
            self.audit.record(site, "connect", "ok")
        return None

    def _on_job_ended(self, message: Message) -> None:
        """A site's job process ended: record it, and take the site's results it offers."""
        site = message.source.split(".", 1)[0]
        code = message.header.get("code")
        try:
            record = self.store.get(str(message.header.get("job_id", "")))
        except FlengineError:
            record = None
        if record is None or site not in record.sites or message.source != site or type(code) is not int:
            REFUSALS.warning(log, "job end refused: %s ran no such job", message.source)
            return None
        self.audit.record(site, "job_process_end", "ok" if code == 0 else "failed", job=record.job_id, code=code)
        try:
            dest = self.store.workspace(record.job_id) / site
            taken = take_results(self.endpoint, site, message.header, dest, job=record)
        except FlengineError as e:
            REFUSALS.warning(log, "results of %s for job %s not taken: %s", site, record.job_id, clip(str(e)))
            self.audit.record(site, "results", "refused", job=record.job_id, reason=str(e))
            self._site_ended(record.job_id, site)
            return None
        if taken is not None:
            self.audit.record(site, "results", "ok", job=record.job_id)
        self._site_ended(record.job_id, site)
        return None

    def _site_ended(self, job_id: str, site: str) -> None:
        with self._lock:
            job = self._running.get(job_id)
            if job is not None:
                job.ended_sites.add(site)

    # ----------------------------------------------------------------- scheduling

    def _schedule_loop(self) -> None:
        while not self.stopped.wait(SCHEDULE_INTERVAL_S):
            try:
                self._schedule_once()
            except Exception:
                log.exception("scheduler error")

    def _reload_loop(self) -> None:
        while not self.stopped.wait(SCHEDULE_INTERVAL_S):
            try:
                self.reload_kit_if_changed()
            except Exception:
                log.exception("kit reload error")

    def reload_kit_if_changed(self) -> bool:
        """Load the allowlist and participants again when the kit's manifest changed; True if reloaded."""
        stamp = _stamp(self.kit.folder / MANIFEST_FILE)
        if stamp == self._kit_stamp:
            return False
        try:
            kit = load_kit(self.kit.folder)
            participants = load_participants(kit.folder / PARTICIPANTS_FILE)
            allowlist = load_allowlist(kit.keys_dir / ALLOWLIST_FOLDER)
        except FlengineError as e:  # maybe half copied: tried again at the next look, until it loads
            if stamp != self._kit_failed:
                log.error("the server kit changed but cannot be loaded; the old allowlist stays: %s", e)
                self.audit.record("server", "reload", "failed", reason=str(e))
                self._kit_failed = stamp
            return False
        self._kit_stamp = stamp
        current = self.endpoint.cell.allowlist
        assert current is not None  # a server cell of a kit always has one
        before = set(current.identities())
        current.replace_with(allowlist)
        self.participants = participants
        added, removed = sorted(set(allowlist.identities()) - before), sorted(before - set(allowlist.identities()))
        self.audit.record("server", "reload", "ok", added=added, removed=removed)
        log.info("server kit reloaded: added=%s removed=%s", added, removed)
        return True

    def _schedule_once(self) -> None:
        for record in self.store.queued():
            if self.stopped.is_set():
                return
            with self._lock:
                if not self._free_ports:
                    self._waiting[record.job_id] = "waiting for a free job port (too many jobs running)"
                    return
            try:
                job = load_job(self.store.job_folder(record.job_id), build=False, environment=False)
            except FlengineError as e:
                self._finish(record.job_id, REJECTED, f"the stored job cannot be loaded: {e}")
                continue
            sites = {name: self._site_state(name) for name in self.connected_sites()}
            known = [name for name, p in self.participants.items() if p.kind == "site"]
            placement = place(job, sites, known)
            if isinstance(placement, Impossible):
                self._finish(record.job_id, REJECTED, f"the job can never run as submitted: {placement}")
                continue
            if isinstance(placement, str):
                with self._lock:
                    self._waiting[record.job_id] = placement
                continue
            self._start_job(record, placement)

    def _site_state(self, site: str) -> SiteState:
        taken: dict[str, float] = collections.defaultdict(float)
        with self._lock:
            for job in self._running.values():
                for key, amount in job.placement.takes.get(site, {}).items():
                    taken[key] += amount
        return SiteState(site, self.participants[site].resources, dict(taken))

    def _start_job(self, record: JobRecord, placement: Placement) -> None:
        with self._lock:
            if record.job_id in self._running or self.store.get(record.job_id).status != JobState.SUBMITTED.value:
                return  # aborted meanwhile (abort_job takes the same lock)
            port = self._free_ports.popleft()
            self._waiting.pop(record.job_id, None)
            running = RunningJob(record, placement, port)
            self._running[record.job_id] = running
        try:
            self._launch(running)
        except Exception as e:  # a full disk, say: the job ends, its port and resources come back
            log.exception("job %s could not be started", record.job_id)
            self._abort_sites(record.job_id, list(placement.sites), "the server could not start the job")
            self._finish(record.job_id, JobState.FINISHED_EXECUTION_EXCEPTION.value, f"could not start: {e}")

    def _launch(self, running: RunningJob) -> None:
        """Deploy to the sites, start them, start the server's job process; stop at an abort."""
        record, placement, port = running.record, running.placement, running.port
        accepted, refused = self._deploy(record, placement, port)
        if not refused and not running.aborted_by:
            refused = self._start_sites(record.job_id, accepted)
        if running.aborted_by or refused:
            why = "the job was aborted" if running.aborted_by else "the job was refused by another site"
            self._abort_sites(record.job_id, accepted, why)
            if running.aborted_by:
                self._finish(record.job_id, JobState.FINISHED_ABORTED.value, running.aborted_by)
            else:
                reason = "; ".join(f"{site}: {why}" for site, why in refused.items())
                self._finish(record.job_id, REJECTED, f"refused by sites: {reason}")
            return
        workspace = self.store.workspace(record.job_id)
        args = [
            "server",
            "--job", str(self.store.job_folder(record.job_id)),
            "--workspace", str(workspace),
            "--site", self.kit.identity,
            "--job-id", record.job_id,
            "--clients", ",".join(placement.sites),
            "--keys", str(self.kit.keys_dir),
            "--host", self.kit.server.bind_host,
            "--port", str(port),
        ]  # fmt: skip
        self.store.update(
            record.job_id, status=JobState.RUNNING.value, started_at=utc_now(), sites=list(placement.sites), port=port
        )
        self.audit.record("server", "job_start", "ok", job=record.job_id, sites=list(placement.sites), port=port)
        log.info("job started: id=%s name=%s sites=%s port=%d", record.job_id, record.name, placement.sites, port)
        with self._lock:  # an abort before this line is seen here, one after it stops the process
            aborted = running.aborted_by
            if not aborted:
                running.process = JobProcess(
                    args, workspace / self.kit.identity, lambda code: self._job_exited(record.job_id, code)
                )
        if aborted:
            self._abort_sites(record.job_id, accepted, "the job was aborted")
            self._finish(record.job_id, JobState.FINISHED_ABORTED.value, aborted)

    def _deploy(self, record: JobRecord, placement: Placement, port: int) -> tuple[list[str], dict[str, str]]:
        """Offer the job to its sites; return who accepted and why the others refused."""
        folder = Path(tempfile.mkdtemp(prefix=f"deploy-{record.job_id}-", dir=self.workspace))
        copy = folder / "job.zip"
        shutil.copyfile(self.store.archive(record.job_id), copy)
        ref = self.endpoint.service.add_file(
            copy, protocol.ARCHIVE_CHUNK_BYTES, list(placement.sites), protocol.DEPLOY_TIMEOUT_S, owned_folder=folder
        )
        header = {
            "job_id": record.job_id,
            "name": record.name,
            "submitter": record.submitter,
            "org": record.submitter_org,
            "port": port,
            "ref": ref,
            "digest": record.digest,
            "size": copy.stat().st_size,
        }

        def ask(site: str) -> tuple[str, str | None]:
            try:
                reply = self.endpoint.cell.request(
                    site, protocol.SITE_CHANNEL, protocol.TOPIC_DEPLOY, header, timeout_s=protocol.DEPLOY_TIMEOUT_S
                )
            except CellError as e:
                return site, f"no answer: {e}"
            if reply.header.get("accepted") is True:
                return site, None
            return site, str(reply.header.get("reason") or reply.reason or "refused")[:500]

        with concurrent.futures.ThreadPoolExecutor(len(placement.sites)) as pool:
            answers = list(pool.map(ask, placement.sites))
        for site, why in answers:
            self.audit.record(
                site, "job_deploy", "accepted" if why is None else "refused", job=record.job_id, reason=why
            )
        accepted = [site for site, why in answers if why is None]
        return accepted, {site: why for site, why in answers if why is not None}

    def _start_sites(self, job_id: str, sites: Sequence[str]) -> dict[str, str]:
        """Tell every site that accepted the job to start it; return the ones that could not."""
        failed = {}
        for site in sites:
            try:
                self.endpoint.cell.request(
                    site, protocol.SITE_CHANNEL, protocol.TOPIC_START, {"job_id": job_id}, timeout_s=30.0
                )
            except CellError as e:
                failed[site] = f"could not start the job: {e}"
        return failed

    def _job_exited(self, job_id: str, code: int) -> None:
        with self._lock:
            job = self._running.get(job_id)
        if job is None:
            return
        outcome = _read_outcome(self.store.workspace(job_id) / self.kit.identity / RESULT_FILE)
        state = outcome.get("state") or JobState.FINISHED_EXECUTION_EXCEPTION.value
        reason = str(outcome.get("reason") or ("" if code == 0 else f"the server job process exited with {code}"))
        if job.aborted_by:
            state, reason = JobState.FINISHED_ABORTED.value, job.aborted_by
        self._abort_sites(job_id, list(job.placement.sites), "the job ended")
        deadline = time.monotonic() + RESULTS_WAIT_S  # so that a finished job's download holds every site's results
        while time.monotonic() < deadline and not self.stopped.is_set():
            with self._lock:
                if job.ended_sites >= set(job.placement.sites):
                    break
            time.sleep(0.1)
        self._finish(job_id, state, reason)

    def _finish(self, job_id: str, state: str, reason: str) -> None:
        with self._lock:
            job = self._running.pop(job_id, None)
            self._waiting.pop(job_id, None)
            if job is not None:
                self._free_ports.append(job.port)  # last in the line: a late client of this job finds nobody
        self.store.update(job_id, status=state, finished_at=utc_now(), reason=reason)
        if job is not None:
            job.finished.set()
        self.audit.record("server", "job_end", state, job=job_id, reason=reason)
        log.info("job ended: id=%s state=%s reason=%s", job_id, state, reason)

    def abort_job(self, job_id: str, actor: str, reason: str) -> JobRecord:
        """Stop a queued or running job; the record says who aborted it and why.

        A job being deployed is only marked: the scheduler stops it between its steps.
        """
        aborted_by = f"aborted by {actor}: {reason}"
        with self._lock:
            job = self._running.get(job_id)
            if job is None:
                if self.store.get(job_id).status == JobState.SUBMITTED.value:
                    self.store.update(
                        job_id, status=JobState.FINISHED_ABORTED.value, finished_at=utc_now(), reason=aborted_by
                    )
                    self._waiting.pop(job_id, None)
                    self.audit.record("server", "job_end", JobState.FINISHED_ABORTED.value, job=job_id)
                return self.store.get(job_id)
            job.aborted_by = aborted_by
            process = job.process
        if process is not None:
            process.stop()
        job.finished.wait(RESULTS_WAIT_S + protocol.DEPLOY_TIMEOUT_S)  # its sites stop and hand in what they have
        return self.store.get(job_id)

    def _abort_sites(self, job_id: str, sites: Sequence[str], reason: str) -> None:
        for site in sites:
            try:
                self.endpoint.cell.request(
                    site,
                    protocol.SITE_CHANNEL,
                    protocol.TOPIC_ABORT,
                    {"job_id": job_id, "reason": reason},
                    timeout_s=30.0,
                )
            except CellError as e:
                log.warning("could not tell %s to stop job %s: %s", site, job_id, e)

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=f"server-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


def _read_outcome(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def reply_json(data: Any, status: Status = Status.OK, reason: str = "") -> Reply:
    """A reply carrying ``data`` as one JSON body frame (what every admin command answers)."""
    return Reply(frames=[json.dumps(data, default=str).encode("utf-8")], status=status, reason=reason)
