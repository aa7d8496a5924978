"""The server's job store: every submitted job on disk, so that the job list survives a restart.

::

    <root>/                     e.g. <server workspace>/jobs
      3f9c0a1b2c4d/             one folder per job id (12 lowercase hex digits)
        job.zip                 the archive as submitted
        job/                    the archive unpacked: the folder the job runs from
        workspace/              the server side's workspace: logs, models, result.json, summary.json
        meta.json               the `JobRecord`, rewritten atomically on every change
        results.zip             the workspace packed for ``download``, once no more results come

A submission is unpacked and checked in a staging folder (``<root>/.incoming-<id>``) and renamed
into place only once it is valid, so a refused job leaves nothing and a half-made one is never
listed. Folders whose name is not a job id are ignored. A ``meta.json`` that cannot be read is
listed as a `StoreStatus.BROKEN` record (and logged), never an exception for the whole store.
Public API::

    from engine.deploy.job_store import JobRecord, JobStore, JobStoreError, StoreStatus
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

from engine.config import Job, Problem, inspect_job
from engine.deploy.archive import JobArchiveError, archive_digest, unpack_job
from engine.errors import ConfigError
from engine.errors import JobStoreError as JobStoreError  # where callers import it from

logger = logging.getLogger(__name__)

ARCHIVE_FILE = "job.zip"
JOB_FOLDER = "job"
WORKSPACE_FOLDER = "workspace"
META_FILE = "meta.json"
RESULTS_FILE = "results.zip"
#: Prefix of the folder in a job's workspace that claims a site's results while they are taken
#: (``workspace/.taking-site-1``, see `engine.deploy.results.take_results`).
RESULTS_CLAIM_PREFIX = ".taking-"
JOB_ID_PATTERN = re.compile(r"^[0-9a-f]{12}$")
#: Why `JobStore.recover` aborts a job that was running when the server stopped.
SERVER_STOPPED_REASON = "the server stopped while the job ran (when is not known)"
#: The reason a job queued again by `JobStore.recover` shows until it runs.
RESUMING_REASON = "resuming from its last completed round: the server stopped while it ran"
#: How often a job is resumed after the server stopped; then it is aborted (a job that crashes the server).
MAX_RESUMES = 3
_STAGING_PREFIX = ".incoming-"
_DELETING_PREFIX = ".deleting-"


class StoreStatus(str, Enum):
    """Where a stored job is in its life.

    The first five have the values of `engine.runtime.states.JobState`, so a job's
    ``summary.json`` state can be stored as it is. ``FINISHED_REJECTED`` is a job the sites or the
    server refused to run; ``BROKEN`` is never written: it marks a record whose ``meta.json``
    could not be read.
    """

    SUBMITTED = "SUBMITTED"
    RUNNING = "RUNNING"
    FINISHED_COMPLETED = "FINISHED_COMPLETED"
    FINISHED_ABORTED = "FINISHED_ABORTED"
    FINISHED_EXECUTION_EXCEPTION = "FINISHED_EXECUTION_EXCEPTION"
    FINISHED_REJECTED = "FINISHED_REJECTED"
    BROKEN = "BROKEN"

    @property
    def is_final(self) -> bool:
        """True for the FINISHED states and BROKEN: nothing more happens to such a job."""
        return self.name.startswith("FINISHED") or self is StoreStatus.BROKEN


def check_job_id(job_id: object) -> str:
    """Return ``job_id`` if it has the form of a job id (12 lowercase hex digits).

    Raises:
        JobStoreError: It does not; check every id that comes from outside with this.
    """
    if not isinstance(job_id, str) or not JOB_ID_PATTERN.match(job_id):
        raise JobStoreError(f"bad job id {job_id!r}: expected 12 lowercase hex digits, as `list` shows")
    return job_id


def new_job_id() -> str:
    """A fresh random job id (12 hex digits of a uuid4)."""
    return uuid.uuid4().hex[:12]


def utc_now() -> str:
    """The time now as an ISO-8601 UTC string with microseconds, as job records store times."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """What the store knows about one job, as kept in its ``meta.json``.

    Attributes:
        job_id: 12 lowercase hex digits.
        name: The job's name from its ``meta.conf``.
        submitter: Identity of the admin who submitted it.
        submitter_org: That admin's organisation.
        status: A `StoreStatus` value (stored as its string).
        submitted_at: When it was submitted (ISO-8601 UTC).
        started_at: When it started running, or None.
        finished_at: When it reached a final status, or None.
        sites: Client sites it runs or ran on; empty until it is scheduled.
        reason: Why it ended or was refused (empty otherwise).
        digest: SHA-256 (hex) of the submitted archive.
        port: The port its server job process listens on, while it runs, or None.
        resumes: How often it was queued again to resume after the server stopped while it ran;
            a SUBMITTED job with resumes > 0 resumes on the sites it ran on.
        results_pending: Sites whose results have not come in yet, once the job ended (they
            hand them in within seconds; a download waits for them).
        states: Every status the job had, in order: ``{"state", "time"}`` (ISO-8601 UTC; None
            where the time is not known, as for a job the server lost), as a summary lists them.
        exit_codes: How each of its job processes ended (the server's and each site's), by
            process name (the server's identity, a site's name); the last run's where it resumed.
    """

    job_id: str
    name: str
    submitter: str
    submitter_org: str
    status: str
    submitted_at: str | None
    started_at: str | None = None
    finished_at: str | None = None
    sites: list[str] = dataclasses.field(default_factory=list)
    reason: str = ""
    digest: str = ""
    port: int | None = None
    resumes: int = 0
    results_pending: list[str] = dataclasses.field(default_factory=list)
    states: list[dict[str, str | None]] = dataclasses.field(default_factory=list)
    exit_codes: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_job_id(self.job_id)
        # Normalise a StoreStatus member to its plain string, so records compare and serialise alike.
        object.__setattr__(self, "status", StoreStatus(self.status).value)
        object.__setattr__(self, "sites", list(self.sites))
        object.__setattr__(self, "results_pending", list(self.results_pending))
        object.__setattr__(self, "states", [dict(entry) for entry in self.states])
        object.__setattr__(self, "exit_codes", dict(self.exit_codes))

    @property
    def is_final(self) -> bool:
        """True when nothing more happens to the job (FINISHED_* or BROKEN)."""
        return StoreStatus(self.status).is_final

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (what ``meta.json`` holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobRecord:
        """Build a record from `to_json` output; unknown keys are ignored.

        Raises:
            JobStoreError: A key is missing or has the wrong type (named).
        """
        if not isinstance(data, Mapping):
            raise JobStoreError(f"job record: expected an object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name not in data:
                if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                    raise JobStoreError(f"job record: missing key {field.name!r}")
                continue
            values[field.name] = _checked(field.name, data[field.name])
        try:
            return cls(**values)
        except ValueError as e:  # an unknown status
            raise JobStoreError(f"job record: status: {e}") from e


_STRING_FIELDS = {"job_id", "name", "submitter", "submitter_org", "status", "reason", "digest"}
_OPTIONAL_STRING_FIELDS = {"submitted_at", "started_at", "finished_at"}


def _checked(key: str, value: Any) -> Any:
    """``value`` if it has the type the record field ``key`` needs; else a `JobStoreError`."""
    if key in _STRING_FIELDS:
        ok = isinstance(value, str)
    elif key in _OPTIONAL_STRING_FIELDS:
        ok = value is None or isinstance(value, str)
    elif key in ("sites", "results_pending"):
        ok = isinstance(value, list) and all(isinstance(site, str) for site in value)
    elif key == "resumes":
        ok = type(value) is int and value >= 0
    elif key == "states":
        ok = isinstance(value, list) and all(_is_state_entry(entry) for entry in value)
    elif key == "exit_codes":
        ok = isinstance(value, dict) and all(
            isinstance(name, str) and type(code) is int for name, code in value.items()
        )
    else:  # port
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise JobStoreError(f"job record: {key}: unexpected value {value!r}")
    return value


def _is_state_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("state"), str)
        and (entry.get("time") is None or isinstance(entry.get("time"), str))
    )


class JobStore:
    """The jobs of one server, one folder each under ``root``; safe to share between threads.

    Args:
        root: The store's folder; created (0700) when missing.

    Example::

        store = JobStore(workspace / "jobs")
        store.recover()                                     # at server start
        record = store.submit(Path("upload.zip"), submitter="alice@a.org", org="a")
        store.update(record.job_id, status=StoreStatus.RUNNING, started_at=utc_now())
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.RLock()

    def submit(
        self, archive: Path, submitter: str, org: str, accept: Callable[[Job], str | None] | None = None
    ) -> JobRecord:
        """Store a job archive (copied), unpack it and check the job; record it as SUBMITTED.

        The job is checked without importing or building anything of it and without reading
        this process's environment: nothing a submitter wrote runs in the server daemon.

        Args:
            archive: The zip the admin sent; the caller keeps (and removes) its own copy.
            submitter: The admin's identity.
            org: The admin's organisation.
            accept: Asked about the checked job before it is stored; a returned reason refuses it.

        Raises:
            JobArchiveError: The archive is refused (see `unpack_job`).
            ConfigError: The job has problems; every one is listed, paths relative to the job.
            JobStoreError: ``accept`` refused the job (its reason).
        """
        job_id = self._free_id()
        staging = self.root / f"{_STAGING_PREFIX}{job_id}"
        staging.mkdir(mode=0o700)
        try:
            stored = staging / ARCHIVE_FILE
            shutil.copyfile(archive, stored)
            os.chmod(stored, 0o600)
            try:
                folder = unpack_job(stored, staging / JOB_FOLDER)
            except JobArchiveError as e:  # the submitter sees its archive, not the server's staging path
                raise JobArchiveError(str(e).replace(str(stored), ARCHIVE_FILE)) from e
            job, problems = inspect_job(folder, build=False, environment=False)  # nothing of it runs here
            if job is None:
                raise ConfigError(_relative(p, folder) for p in problems)
            refusal = accept(job) if accept is not None else None
            if refusal:
                raise JobStoreError(refusal)
            (staging / WORKSPACE_FOLDER).mkdir(mode=0o700)
            submitted_at = utc_now()
            record = JobRecord(
                job_id=job_id,
                name=str(job.meta.data["name"]),
                submitter=submitter,
                submitter_org=org,
                status=StoreStatus.SUBMITTED,
                submitted_at=submitted_at,
                digest=archive_digest(stored),
                states=[{"state": StoreStatus.SUBMITTED.value, "time": submitted_at}],
            )
            _write_meta(staging / META_FILE, record)
            with self._lock:
                os.rename(staging, self.root / job_id)
                _fsync_folder(self.root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("job submitted job_id=%s name=%s submitter=%s org=%s", job_id, record.name, submitter, org)
        return record

    def get(self, job_id: str) -> JobRecord:
        """The record of one job (a BROKEN record when its ``meta.json`` cannot be read).

        Raises:
            JobStoreError: The id is malformed, or there is no such job.
        """
        return self._read(self._folder(job_id))

    def list(self) -> list[JobRecord]:
        """Every job, in submission order; broken records last."""
        records = []
        for folder in self.root.iterdir():
            if JOB_ID_PATTERN.match(folder.name) and folder.is_dir() and not folder.is_symlink():
                records.append(self._read(folder))
        return sorted(records, key=lambda r: (r.status == StoreStatus.BROKEN, r.submitted_at or "", r.job_id))

    def queued(self) -> list[JobRecord]:
        """The jobs waiting to run (SUBMITTED), in submission order."""
        return [r for r in self.list() if r.status == StoreStatus.SUBMITTED]

    def update(self, job_id: str, **changes: Any) -> JobRecord:
        """Change fields of a job's record and write it atomically; returns the new record.

        A new status is added to the record's ``states`` with the time now (a final one with the
        ``finished_at`` given beside it, None included: a time not known).

        Args:
            job_id: The job.
            **changes: `JobRecord` fields and their new values (``job_id`` cannot change).

        Raises:
            JobStoreError: Unknown or malformed id, or the job's record is broken.
            ValueError: An unknown status.
            TypeError: An unknown field.
        """
        if "job_id" in changes:
            raise TypeError("update() cannot change job_id")
        with self._lock:
            folder = self._folder(job_id)
            record = self._read(folder)
            if record.status == StoreStatus.BROKEN:
                raise JobStoreError(f"job {job_id}: its record is broken ({record.reason}); it cannot be updated")
            if changes.get("status") == StoreStatus.BROKEN:
                raise ValueError("BROKEN is not a status a job can be given")
            updated = dataclasses.replace(record, **changes)
            if updated.status != record.status and "states" not in changes:
                # The status's time is the one the change gives (an end, a first start), so that
                # a duration from the states equals the one from started_at and finished_at.
                final = StoreStatus(updated.status).is_final and "finished_at" in changes
                first_start = updated.status == StoreStatus.RUNNING and not record.started_at
                running = first_start and changes.get("started_at")
                time = changes["finished_at"] if final else running or utc_now()
                entry = {"state": updated.status, "time": time}
                updated = dataclasses.replace(updated, states=[*record.states, entry])
            _write_meta(folder / META_FILE, updated)
        return updated

    def record_exit(self, job_id: str, process: str, code: int) -> JobRecord:
        """Note that the job's process ``process`` (the server's identity, or a site) exited with ``code``.

        Raises:
            JobStoreError: Unknown or malformed id, or the job's record is broken.
        """
        with self._lock:  # read and written under one lock: concurrent exits of several sites all count
            codes = {**self.get(job_id).exit_codes, process: code}
            return self.update(job_id, exit_codes=codes)

    def recover(self, resume: Callable[[JobRecord], bool] | None = None) -> list[JobRecord]:
        """At server start: queue again or abort every job left RUNNING; remove leftover staging folders and claims.

        A results claim left by a stop mid-download would refuse that site's results, and keep
        the job's results from being packed once, for ever.

        Args:
            resume: Whether a job left RUNNING can resume (its server process kept checkpoints):
                such a job, resumed fewer than `MAX_RESUMES` times, is SUBMITTED again with its
                ``resumes`` counted up and `RESUMING_REASON`, its sites and port kept.

        Returns:
            The jobs that were RUNNING and are now FINISHED_ABORTED with reason `SERVER_STOPPED_REASON`.
        """
        with self._lock:
            for leftover in self.root.iterdir():
                if leftover.name.startswith((_STAGING_PREFIX, _DELETING_PREFIX)):
                    shutil.rmtree(leftover, ignore_errors=True)
            aborted = []
            for record in self.list():
                workspace = self.root / record.job_id / WORKSPACE_FOLDER
                for claim in workspace.glob(f"{RESULTS_CLAIM_PREFIX}*") if workspace.is_dir() else ():
                    shutil.rmtree(claim, ignore_errors=True)
                if record.status == StoreStatus.RUNNING and resume is not None and resume(record):
                    if record.resumes < MAX_RESUMES:
                        self.update(record.job_id, status=StoreStatus.SUBMITTED, resumes=record.resumes + 1,
                                    reason=RESUMING_REASON)  # fmt: skip
                        logger.warning("job queued to resume job_id=%s resumes=%d", record.job_id, record.resumes + 1)
                        continue
                if record.status == StoreStatus.RUNNING:
                    aborted.append(
                        self.update(
                            record.job_id,
                            status=StoreStatus.FINISHED_ABORTED,
                            finished_at=None,  # when it stopped is not known: not the time of this restart
                            reason=SERVER_STOPPED_REASON,
                            port=None,
                        )
                    )
                    logger.warning(
                        "job aborted at server start job_id=%s reason=%s", record.job_id, SERVER_STOPPED_REASON
                    )
        return aborted

    def delete(self, job_id: str) -> None:
        """Remove a finished (or broken) job and everything stored for it.

        Raises:
            JobStoreError: Unknown or malformed id, or the job has not finished.
        """
        with self._lock:
            folder = self._folder(job_id)
            record = self._read(folder)
            if not record.is_final:
                raise JobStoreError(
                    f"job {job_id} is {record.status}; only finished jobs can be deleted (abort it first)"
                )
            # Renamed first so that a crash half-way never leaves a half-deleted job in the list.
            doomed = self.root / f"{_DELETING_PREFIX}{job_id}"
            os.rename(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def job_folder(self, job_id: str) -> Path:
        """The job's unpacked folder, the one it runs from."""
        return self._folder(job_id) / JOB_FOLDER

    def workspace(self, job_id: str) -> Path:
        """The workspace of the job's server side (logs, models, ``result.json``)."""
        return self._folder(job_id) / WORKSPACE_FOLDER

    def archive(self, job_id: str) -> Path:
        """The job's archive as submitted (what the sites are sent)."""
        return self._folder(job_id) / ARCHIVE_FILE

    def results_archive(self, job_id: str) -> Path:
        """Where the job's workspace is kept packed for downloads (it may not exist yet)."""
        return self._folder(job_id) / RESULTS_FILE

    def _folder(self, job_id: str) -> Path:
        folder = self.root / check_job_id(job_id)
        if not folder.is_dir() or folder.is_symlink():
            raise JobStoreError(f"no job {job_id}")
        return folder

    def _free_id(self) -> str:
        while True:
            job_id = new_job_id()
            if not (self.root / job_id).exists() and not (self.root / f"{_STAGING_PREFIX}{job_id}").exists():
                return job_id

    def _read(self, folder: Path) -> JobRecord:
        """The record in ``folder/meta.json``; a BROKEN record (logged) when it cannot be read."""
        path = folder / META_FILE
        try:
            record = JobRecord.from_json(json.loads(path.read_text(encoding="utf-8")))
            if record.job_id != folder.name:
                raise JobStoreError(f"job record: job_id {record.job_id!r} is not the folder's name")
            return record
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, JobStoreError) as e:
            logger.warning("broken job record job_id=%s file=%s error=%s", folder.name, path, e)
            return JobRecord(
                job_id=folder.name,
                name="",
                submitter="",
                submitter_org="",
                status=StoreStatus.BROKEN,
                submitted_at=None,
                reason=f"{META_FILE} cannot be read: {e}",
            )


def _write_meta(path: Path, record: JobRecord) -> None:
    """Write ``path`` atomically: a temporary file, fsync, rename, fsync of the folder."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    data = (json.dumps(record.to_json(), indent=2) + "\n").encode("utf-8")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _relative(problem: Problem, folder: Path) -> Problem:
    """``problem`` with its file named relative to the job (the staging path means nothing to users)."""
    prefix = os.fspath(folder)
    file = problem.file
    if file == prefix:
        file = "."
    elif file.startswith(prefix + os.sep):
        file = file[len(prefix) + 1 :]
    return dataclasses.replace(problem, file=file)
