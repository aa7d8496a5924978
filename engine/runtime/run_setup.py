"""What a simulation run is made of before it starts: its clients, its workspace, its workers' plan.

`engine.runtime.simulator` calls these while the launcher imports torch: the client names a job
and ``-n`` give, whether the run is CURVE or not (every config must agree), the new workspace
folder, the plan of virtual clients for ``-t`` (refused for workflows whose clients must work at
the same time), and, once it ends, the lines it shows about a process that failed and the report.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from datetime import datetime
from pathlib import Path

from engine.config import Job
from engine.config.build import resolve_dotted_path
from engine.errors import FlengineError, UsageError
from engine.runtime.workers import WorkerPlan
from engine.site import insecure_requested
from engine.text import printable

#: What ``flengine run --resume`` needs of a run (`RunRecord`), in its workspace.
RUN_FILE = "run.json"
#: Lines of a process's stderr.txt shown when it exits early, and the most bytes read for them.
ERROR_TAIL_LINES = 5
ERROR_TAIL_BYTES = 16384
#: The longest stderr line kept in a reason (a traceback line can be long).
ERROR_LINE_CHARS = 300


def report_hint(folder: Path) -> str:
    """The line that says how to get the run's HTML report (drawing it takes about a second: not done here)."""
    command = f"flengine report {folder}"
    if importlib.util.find_spec("matplotlib") is None:
        return f"report: pip install flengine[report], then {command}"
    return f"report: {command}"


def error_tail(file: Path, lines: int = ERROR_TAIL_LINES) -> list[str]:
    """The last non-empty ``lines`` of a process's ``stderr.txt``, each made `printable` and cut short.

    At most `ERROR_TAIL_BYTES` are read from the end; a missing file gives no lines.
    """
    try:
        with file.open("rb") as stream:
            stream.seek(max(stream.seek(0, os.SEEK_END) - ERROR_TAIL_BYTES, 0))
            text = stream.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    return [printable(line, ERROR_LINE_CHARS) for line in kept[-lines:]]


def insecure_run(job: Job, sites: list[str]) -> bool:
    """Whether the job turns CURVE off (``cell.insecure = true``); every config must agree."""
    choices: dict[bool, str] = {}
    for site in sites:
        app = job.app_for(site)
        document = None if app is None else (app.server if site == "server" else app.client)
        if document is not None:
            choices.setdefault(insecure_requested(document.data), document.display)
    if len(choices) > 1:
        raise UsageError(
            f"{choices[True]}: cell.insecure = true, but {choices[False]} keeps CURVE on; a server and its "
            "clients must agree: set it in every config of the job, or in none"
        )
    return True in choices


def client_names(job: Job, n_clients: int | None) -> list[str]:
    n = job.min_clients if n_clients is None else n_clients
    if n < 1:
        raise UsageError(f"-n: expected at least 1 client, got {n}")
    if n < job.min_clients:
        raise UsageError(f"-n {n}: the job needs at least min_clients = {job.min_clients} clients (meta)")
    names = [f"site-{i}" for i in range(1, n + 1)]
    for site in ["server", *names]:
        app = job.app_for(site)
        config = None if app is None else (app.server if site == "server" else app.client)
        if config is None:
            raise UsageError(f"{job.folder}: deploy_map gives {site} no app with a config_fed_{_side(site)}")
    return names


def worker_plan(job: Job, clients: list[str], workers: int | None) -> WorkerPlan | None:
    """The virtual clients' plan for ``-t workers`` (None without), once the job is known to allow it.

    Raises:
        UsageError: ``-t`` below 1, or a workflow whose clients must work at the same time (Swarm).
    """
    if workers is None:
        return None
    app = job.app_for("server")
    entries = [] if app is None or app.server is None else app.server.data.get("workflows", [])
    for entry in entries:
        path = entry.get("path") if isinstance(entry, dict) else None
        try:
            workflow = resolve_dotted_path(path) if isinstance(path, str) else None
        except FlengineError:  # validated before: a custom workflow this process cannot import is the server's problem
            continue
        if getattr(workflow, "needs_live_clients", False):
            raise UsageError(
                f"-t: workflow {entry.get('id', path)!r} ({path}) has its clients work together at the same time; "
                "virtual clients run one at a time: run this job without -t (a process per client)"
            )
    return WorkerPlan.round_robin(clients, workers)


def _side(site: str) -> str:
    return "server" if site == "server" else "client"


def prepare_workspace(job: Job, workspace: str | os.PathLike[str] | None) -> Path:
    if workspace is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = Path("workspace") / f"{job.name}-{stamp}"
        suffix = 1
        while folder.exists():
            suffix += 1
            folder = Path("workspace") / f"{job.name}-{stamp}-{suffix}"
    else:
        folder = Path(workspace)
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise UsageError(f"--workspace {folder}: not an empty folder; choose a new one or empty it")
    folder.mkdir(parents=True, exist_ok=True)
    return folder.resolve()


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What ``flengine run --resume`` needs of a run: its job folder, clients, job id, allowed folders, workers."""

    job: Path
    clients: list[str]
    job_id: str
    allowed_dirs: list[Path]
    workers: int | None = None

    def write(self, folder: Path) -> None:
        """Write the record into the run's workspace ``folder`` (`RUN_FILE`)."""
        record = {
            "job": str(self.job),
            "clients": self.clients,
            "job_id": self.job_id,
            "allowed_dirs": [str(path) for path in self.allowed_dirs],
            "workers": self.workers,
        }
        (folder / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, folder: Path) -> RunRecord:
        """The record of the run in ``folder``.

        Raises:
            UsageError: The folder is not a simulator workspace (no readable record).
        """
        try:
            record = json.loads((folder / RUN_FILE).read_text(encoding="utf-8"))
            workers = int(record["workers"]) if record.get("workers") else None
            return cls(
                Path(record["job"]),
                [str(site) for site in record["clients"]],
                str(record["job_id"]),
                [Path(path) for path in record.get("allowed_dirs") or []],
                workers,
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(
                f"--resume {folder}: not the workspace of a flengine run ({RUN_FILE} unreadable: {e})"
            ) from e
