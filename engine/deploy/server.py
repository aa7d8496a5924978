"""`ServerDaemon`: the long-running server of production mode (``flengine server start KIT``).

It runs until stopped (SIGTERM, Ctrl-C or an admin's ``shutdown``) and:

- accepts the project's sites and admins on the kit's port (CURVE; the allowlist is exactly the
  keys the kit's manifest lists, any other file in ``keys/allowlist/`` is ignored and logged; a
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
- picks up a re-provisioned server kit without a restart (`engine.deploy.kit_reload`): when
  the kit's ``MANIFEST.json`` changes, the kit is verified again and its allowlist and
  participants replace the old ones. A participant that left is **revoked**: each site's
  running job processes are told to stop first, then its cells are told BYE and unregistered
  (within half a second) and every further message of its connections is refused; the
  scheduler forgets it at once. A kit that still fails the check after a few seconds is
  logged and audited, and the old settings stay.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cells import Message
from engine.cells.log_limit import REFUSALS
from engine.config import load_job
from engine.deploy import protocol
from engine.deploy.audit import AuditLog, clip
from engine.deploy.authz import load_participants
from engine.deploy.folders import private_folder
from engine.deploy.job_process import JobProcess
from engine.deploy.job_store import MAX_RESUMES, JobRecord, JobStore, utc_now
from engine.deploy.job_summary import write_job_summary
from engine.deploy.kit_reload import KitChange, KitWatcher
from engine.deploy.ports import JobPorts
from engine.deploy.results import take_results
from engine.deploy.resume import resume_placement
from engine.deploy.scheduler import Impossible, Placement, SiteState, place
from engine.deploy.site_requests import abort_sites, deploy_to_sites, resume_sites, start_sites
from engine.errors import CellError, FlengineError, UsageError
from engine.provision import Kit, Participant
from engine.provision.kit import PARTICIPANTS_FILE
from engine.runtime.states import JobState
from engine.site import SiteEndpoint

log = logging.getLogger(__name__)

#: Seconds between two looks of the scheduler at the queue.
SCHEDULE_INTERVAL_S = 1.0
#: The job process's outcome file, in its site folder of the job workspace.
RESULT_FILE = "result.json"
REJECTED = "FINISHED_REJECTED"
#: Seconds a revoked site has to acknowledge that its job processes must stop, per job.
REVOKE_NOTICE_TIMEOUT_S = 2.0


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
        self._ports = JobPorts(job_ports or range(first, first + protocol.DEFAULT_JOB_PORTS), kit.server.bind_host)
        self.participants = load_participants(kit.folder / PARTICIPANTS_FILE)
        self.store = JobStore(self.workspace / "jobs")
        self.audit = AuditLog(self.workspace / "audit.log")
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._stopping = threading.Lock()  # one `stop` at a time
        self._seen: dict[str, float] = {}  # site -> last status, monotonic
        self._running: dict[str, RunningJob] = {}
        self._waiting: dict[str, str] = {}  # job id -> why it waits
        self._endpoint: SiteEndpoint | None = None
        self._threads: list[threading.Thread] = []
        self._watcher: KitWatcher | None = None
        self._reload_lock = threading.Lock()  # one reload at a time (the reload thread, or a caller)
        self._summary_lock = threading.Lock()

    # ----------------------------------------------------------------- life

    def start(self) -> ServerDaemon:
        """Recover the job store, open the cell, start the scheduler."""
        from engine.deploy.commands import AdminCommands  # the commands use this daemon

        for record in self.store.recover(resume=self._kept_checkpoints):
            self.audit.record("server", "job_end", record.status, job=record.job_id, reason=record.reason)
        for record in self.store.queued():
            if record.resumes:
                self.audit.record("server", "job_resume", "queued", job=record.job_id, resumes=record.resumes)
        self._report_ignored(self.kit)
        security = self.kit.cell_security()  # the allowlist of the manifest, not every file of the folder
        assert security.allowlist is not None
        self._watcher = KitWatcher(self.kit, security.allowlist.identities())
        endpoint = SiteEndpoint(self.kit.identity, self.kit.cell_settings(), security, {}, workspace=self.workspace)
        self._endpoint = endpoint.start()
        cell = self._endpoint.cell
        commands = AdminCommands(self)
        cell.register_handler(protocol.ADMIN_CHANNEL, protocol.TOPIC_COMMAND, commands.handle)
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_STATUS, self._on_site_status)
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_JOB_ENDED, self._on_job_ended)
        cell.register_handler(protocol.SITE_CHANNEL, protocol.TOPIC_JOB_PROCESS_EXITED, self._on_job_process_exited)
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
        """Stop every running job's server process, then close the cell (safe to call twice).

        The jobs stay RUNNING in the store: they resume when the server starts again. Two
        threads may call it at once (``admin shutdown``'s timer, and the main thread it wakes):
        the second waits for the first and returns.
        """
        with self._stopping:
            if self._endpoint is None:
                return
            self.stopped.set()
            with self._lock:
                running = list(self._running.values())
            for job in running:
                log.info(
                    "job %s stopped with the server (%s); it resumes when the server starts again",
                    job.record.job_id,
                    reason,
                )
                if job.process is not None:
                    job.process.stop()
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join(5.0)
            self.audit.record("server", "stop", "ok", reason=reason)
            self._endpoint.close()
            self._endpoint = None
            log.info("server stopped: %s", reason)

    # ----------------------------------------------------------------- sites

    def connected_sites(self) -> dict[str, float]:
        """Sites of the project heard from within `protocol.STATUS_TIMEOUT_S`: name -> seconds since last status."""
        now = time.monotonic()
        with self._lock:
            return {
                site: now - seen
                for site, seen in self._seen.items()
                if now - seen <= protocol.STATUS_TIMEOUT_S and site in self.participants
            }

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
        with self._lock:  # the same lock as a reload: a site revoked meanwhile is not seen again
            participant = self.participants.get(site)
            known = participant is not None and participant.kind == "site" and message.source == site
            first = site not in self._seen or time.monotonic() - self._seen[site] > protocol.STATUS_TIMEOUT_S
            if known:
                self._seen[site] = time.monotonic()
        if not known:
            REFUSALS.warning(log, "site status refused: %s is not a site of this project", message.source)
            return None
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
        self.store.record_exit(record.job_id, site, code)  # for the job's summary
        with self._lock:
            running = self._running.get(record.job_id)
            process = running.process if running is not None else None
        if process is not None:  # its job goes on without the site at once, not after the heartbeat timeout
            process.tell_exit(site, code)
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

    def _kept_checkpoints(self, record: JobRecord) -> bool:
        """Whether a job left RUNNING can resume: its server process ran (and kept its checkpoints there)."""
        return (self.store.workspace(record.job_id) / self.kit.identity).is_dir()

    def _on_job_process_exited(self, message: Message) -> None:
        """A site's job process crashed and its daemon starts it again: the job leaves the site out meanwhile."""
        site, job_id, code = message.source, str(message.header.get("job_id", "")), message.header.get("code")
        with self._lock:
            running = self._running.get(job_id)
            process = running.process if running is not None and site in running.placement.sites else None
        if process is None or type(code) is not int:
            REFUSALS.warning(log, "job process exit refused: %s runs no such job", site)
            return None
        self.audit.record(site, "job_process_crash", "restarting", job=job_id, code=code)
        process.tell_exit(site, code)
        return None

    def _site_ended(self, job_id: str, site: str) -> None:
        with self._lock:
            job = self._running.get(job_id)
            if job is not None:
                job.ended_sites.add(site)
        record = self.store.get(job_id)
        if job is not None and site in record.results_pending:  # the job ended: its results come in
            self.store.update(job_id, results_pending=[s for s in record.results_pending if s != site])

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
        """Load the allowlist and participants again when the kit's manifest changed; True if reloaded.

        A kit that stays broken is logged and audited (``reload failed``) once per version of
        its manifest, and the old allowlist and participants stay.
        """
        if self._watcher is None:
            raise RuntimeError("the server daemon is not started")
        with self._reload_lock:
            try:
                change = self._watcher.poll()
            except FlengineError as e:
                log.error("the server kit changed but cannot be loaded; the old allowlist stays: %s", e)
                self.audit.record("server", "reload", "failed", reason=str(e))
                return False
            if change is None:
                return False
            self._apply(change)
            return True

    def _apply(self, change: KitChange) -> None:
        """Switch to a reloaded kit; revoke the participants that left it."""
        revoked_sites = [name for name in change.removed if self._is_site(name)]
        self._tell_revoked(revoked_sites)  # while they may still hear it
        current = self.endpoint.cell.allowlist
        assert current is not None  # a server cell of a kit always has one
        current.replace_with(change.allowlist)  # the cell closes the revoked registrations at its next sweep
        with self._lock:
            self.participants = change.participants
            self.kit = change.kit
            for name in change.removed:
                self._seen.pop(name, None)
            for job in self._running.values():
                job.ended_sites.update(set(revoked_sites) & set(job.placement.sites))  # no results to wait for
        self._report_ignored(change.kit)
        self.audit.record("server", "reload", "ok", added=change.added, removed=change.removed)
        log.info("server kit reloaded: added=%s removed=%s", change.added, change.removed)

    def _is_site(self, name: str) -> bool:
        participant = self.participants.get(name)
        return participant is not None and participant.kind == "site"

    def _tell_revoked(self, sites: Sequence[str]) -> None:
        """Tell each revoked site to stop its running job processes.

        The job's server process is told too: it drops the site from its allowlist (every further
        message of the site on the job's port is refused) and goes on without it.
        """
        for site in sites:
            jobs = sorted(job_id for job_id, job in self.running_jobs().items() if site in job.placement.sites)
            for job_id in jobs:
                process = self.running_jobs()[job_id].process
                if process is not None:  # the job's own port refuses the site from now on
                    process.tell_revoked(site)
                reason = f"{site} was revoked: its key left the server's allowlist"
                try:
                    self.endpoint.cell.request(
                        site,
                        protocol.SITE_CHANNEL,
                        protocol.TOPIC_ABORT,
                        {"job_id": job_id, "reason": reason},
                        timeout_s=REVOKE_NOTICE_TIMEOUT_S,
                    )
                    outcome = "ok"
                except CellError as e:
                    log.warning("could not tell revoked %s to stop job %s: %s", site, job_id, e)
                    outcome = "failed"
                self.audit.record("server", "job_site_revoked", outcome, job=job_id, site=site)

    def _report_ignored(self, kit: Kit) -> None:
        for name in kit.ignored_files:
            log.warning(
                "ignored file=%s reason=not in the kit's manifest (left by a copy over an older kit?); "
                "it is not read; delete it, or replace the kit folder",
                kit.folder / name,
            )
        if kit.ignored_files:
            self.audit.record("server", "kit_files_ignored", "ok", files=list(kit.ignored_files))

    def _schedule_once(self) -> None:
        for record in self.store.queued():
            if self.stopped.is_set():
                return
            with self._lock:
                if not self._ports:
                    self._waiting[record.job_id] = "waiting for a free job port (too many jobs running)"
                    return
            try:
                job = load_job(self.store.job_folder(record.job_id), build=False, environment=False)
            except FlengineError as e:
                self._finish(record.job_id, REJECTED, f"the stored job cannot be loaded: {e}")
                continue
            participants = self.participants  # one version for the whole look: a reload may swap it
            sites = {
                name: self._site_state(name, participants[name])
                for name in self.connected_sites()
                if name in participants
            }
            known = [name for name, p in participants.items() if p.kind == "site"]
            placement = resume_placement(record, job, sites, known) if record.resumes else place(job, sites, known)
            if isinstance(placement, Impossible):
                self._finish(record.job_id, REJECTED, f"the job can never run as submitted: {placement}")
                continue
            if isinstance(placement, str):
                with self._lock:
                    self._waiting[record.job_id] = placement
                continue
            self._start_job(record, placement)

    def _site_state(self, site: str, participant: Participant) -> SiteState:
        taken: dict[str, float] = collections.defaultdict(float)
        with self._lock:
            for job in self._running.values():
                for key, amount in job.placement.takes.get(site, {}).items():
                    taken[key] += amount
        return SiteState(site, participant.resources, dict(taken))

    def _start_job(self, record: JobRecord, placement: Placement) -> None:
        with self._lock:
            if record.job_id in self._running or self.store.get(record.job_id).status != JobState.SUBMITTED.value:
                return  # aborted meanwhile (abort_job takes the same lock)
            port = self._ports.take(record.port if record.resumes else None)  # a resumed job: the port its sites knew
            if port is None:
                self._waiting[record.job_id] = f"waiting for a free job port: {self._ports.held_elsewhere()}"
                return
            self._waiting.pop(record.job_id, None)
            running = RunningJob(record, placement, port)
            self._running[record.job_id] = running
        try:
            self._launch(running)
        except Exception as e:  # a full disk, say: the job ends, its port and resources come back
            log.exception("job %s could not be started", record.job_id)
            abort_sites(self.endpoint.cell, record.job_id, list(placement.sites), "the server could not start the job")
            self._finish(record.job_id, JobState.FINISHED_EXECUTION_EXCEPTION.value, f"could not start: {e}")

    def _launch(self, running: RunningJob) -> None:
        """Deploy to the sites, start them, start the server's job process; stop at an abort."""
        record, placement, port = running.record, running.placement, running.port
        if record.resumes:  # the sites have the job: they start its process again
            accepted = list(placement.sites)
            refused = {} if running.aborted_by else resume_sites(self.endpoint.cell, record.job_id, port, accepted)
        else:
            accepted, refused = deploy_to_sites(
                self.endpoint, self.store.archive(record.job_id), self.workspace, record, placement.sites, port
            )
            for site in placement.sites:
                why = refused.get(site)
                self.audit.record(
                    site, "job_deploy", "accepted" if why is None else "refused", job=record.job_id, reason=why
                )
            if not refused and not running.aborted_by:
                refused = start_sites(self.endpoint.cell, record.job_id, accepted)
        if running.aborted_by or refused:
            why = "the job was aborted" if running.aborted_by else "the job was refused by another site"
            abort_sites(self.endpoint.cell, record.job_id, accepted, why)
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
            *(["--resume"] if record.resumes else []),
        ]  # fmt: skip
        started_at = record.started_at if record.resumes and record.started_at else utc_now()
        self.store.update(
            record.job_id,
            status=JobState.RUNNING.value,
            started_at=started_at,
            sites=list(placement.sites),
            port=port,
            reason="",
        )
        self.audit.record("server", "job_start", "ok", job=record.job_id, sites=list(placement.sites), port=port)
        log.info("job started: id=%s name=%s sites=%s port=%d", record.job_id, record.name, placement.sites, port)
        with self._lock:  # an abort before this line is seen here, one after it stops the process
            aborted = running.aborted_by
            if not aborted:
                running.process = JobProcess(
                    args,
                    workspace / self.kit.identity,
                    lambda code: self._job_exited(record.job_id, code),
                    exit_notices=True,
                )
        if aborted:
            abort_sites(self.endpoint.cell, record.job_id, accepted, "the job was aborted")
            self._finish(record.job_id, JobState.FINISHED_ABORTED.value, aborted)

    def _job_exited(self, job_id: str, code: int) -> None:
        with self._lock:
            job = self._running.get(job_id)
        if job is None:
            return
        if self.stopped.is_set() and not job.aborted_by:  # the server stops: the job resumes at its next start
            self.audit.record("server", "job_stopped", "resumes_at_start", job=job_id, code=code)
            self._release(job_id)
            return
        outcome = _read_outcome(self.store.workspace(job_id) / self.kit.identity / RESULT_FILE)
        if not outcome and code != 0 and not job.aborted_by and not self.stopped.is_set():
            if self._resume_crashed(job, code):  # it crashed: its checkpoints let it go on
                return
        state = outcome.get("state") or JobState.FINISHED_EXECUTION_EXCEPTION.value
        reason = str(outcome.get("reason") or ("" if code == 0 else f"the server job process exited with {code}"))
        if job.aborted_by:
            state, reason = JobState.FINISHED_ABORTED.value, job.aborted_by
        # The record says how the job ended at once; the sites' results follow within seconds.
        with self._lock:
            pending = [site for site in job.placement.sites if site not in job.ended_sites]
        self.store.update(job_id, status=state, finished_at=utc_now(), reason=reason, results_pending=pending)
        self.store.record_exit(job_id, self.kit.identity, code)
        self.audit.record("server", "job_end", state, job=job_id, reason=reason)
        log.info("job ended: id=%s state=%s reason=%s", job_id, state, reason)
        abort_sites(self.endpoint.cell, job_id, list(job.placement.sites), "the job ended")
        deadline = (
            time.monotonic() + protocol.RESULTS_WAIT_S
        )  # so that a finished job's download holds every site's results
        while time.monotonic() < deadline and not self.stopped.is_set():
            with self._lock:
                if job.ended_sites >= set(job.placement.sites):
                    break
            time.sleep(0.1)
        with self._lock:
            missing = sorted(set(job.placement.sites) - job.ended_sites)
        if missing:
            log.warning("job %s: no results from %s within %g s", job_id, ", ".join(missing), protocol.RESULTS_WAIT_S)
        self._release(job_id)
        self.store.update(job_id, results_pending=[])
        self.write_summary(job_id)

    def write_summary(self, job_id: str) -> None:
        """Write the job's ``summary.json`` into its workspace from what is known now (`write_job_summary`).

        Called when a job's results are in, and again before its workspace is packed for a
        download (results that came in late, a job that never ran). A failure is logged: the
        job's results are whole without it.
        """
        with self._summary_lock:  # one writer at a time: the last one written holds everything
            try:
                write_job_summary(self.store.get(job_id), self.store.workspace(job_id), self.kit.identity)
            except (OSError, FlengineError) as e:
                log.warning("summary of job %s not written: %s", job_id, e)

    def _resume_crashed(self, job: RunningJob, code: int) -> bool:
        """Queue a job whose server process crashed to resume (its sites start again); False when it cannot."""
        record = self.store.get(job.record.job_id)
        if record.resumes >= MAX_RESUMES or not self._kept_checkpoints(record):
            return False
        self._release(record.job_id)
        self.store.update(
            record.job_id,
            status=JobState.SUBMITTED.value,
            resumes=record.resumes + 1,
            reason=f"resuming from its last completed round: the server job process exited with {code}",
        )
        self.audit.record("server", "job_resume", "queued", job=record.job_id, resumes=record.resumes + 1, code=code)
        log.warning("job %s: its server process exited with %d; resuming it", record.job_id, code)
        return True

    def _release(self, job_id: str) -> None:
        """The job no longer runs here: its port comes back, and whoever waits for its end goes on."""
        with self._lock:
            job = self._running.pop(job_id, None)
            self._waiting.pop(job_id, None)
            if job is not None:
                self._ports.give_back(job.port)
        if job is not None:
            job.finished.set()

    def _finish(self, job_id: str, state: str, reason: str) -> None:
        """The job ended before its server process ran (refused, aborted, could not start): record it, release it."""
        self.store.update(job_id, status=state, finished_at=utc_now(), reason=reason)
        self._release(job_id)
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
        job.finished.wait(
            protocol.RESULTS_WAIT_S + protocol.DEPLOY_TIMEOUT_S
        )  # its sites stop and hand in what they have
        return self.store.get(job_id)

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=f"server-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)


def _read_outcome(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
