"""The simulator behind ``flengine run``: a server process and N client processes on this machine.

It has the server and ``site-1`` .. ``site-N`` forked at once by one launcher process that
imported torch once (`engine.runtime.launcher`), gives the clients the server's endpoint when it
listens, shows the server's progress events as they come, and stops everything on success, on
failure and on Ctrl-C. At the end it writes ``<workspace>/summary.json`` (states, rounds,
per-process peak RSS, the time of each stage of the run: `engine.runtime.timings`) and prints a
summary table (with ``-v``, the stage times too).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from engine.config import Job, load_job
from engine.errors import UsageError
from engine.runtime.follow import LOG_LINE_EVENT, FileFollower, follow_run
from engine.runtime.launcher import LAUNCHER_ERRORS_FILE, LaunchedProcess, Launcher, command_line_room
from engine.runtime.live import LiveConsole, make_printer
from engine.runtime.process import LOG_FILE
from engine.runtime.progress import summary_table
from engine.runtime.run_warnings import run_warnings
from engine.runtime.states import JobState
from engine.runtime.summary import SUMMARY_FILE as SUMMARY_FILE  # where summary.json is named, for callers
from engine.runtime.summary import client_ready_times, server_result, write_summary
from engine.runtime.timings import RunTimings, timing_lines
from engine.security import write_site_key_folders
from engine.site import INSECURE_WARNING, insecure_requested
from engine.text import printable

log = logging.getLogger(__name__)

#: The run's throw-away keys, under its workspace; removed when the run ends.
KEYS_FOLDER = "keys"
#: What ``flengine run --resume`` needs of a run (job folder, clients, job id, allowed folders), in its workspace.
RUN_FILE = "run.json"
#: Seconds to wait for the server to report its endpoint.
STARTUP_TIMEOUT_S = 60.0
#: Seconds processes get to exit by themselves before they are terminated, then killed.
STOP_GRACE_S = 20.0
#: Lines of a process's stderr.txt shown when it exits early, and the most bytes read for them.
ERROR_TAIL_LINES = 5
ERROR_TAIL_BYTES = 16384
#: The longest stderr line kept in a reason (a traceback line can be long).
ERROR_LINE_CHARS = 300


@dataclass
class SimulationResult:
    """What `run_simulation` leaves behind: the final state and the summary written to disk."""

    state: JobState
    workspace: Path
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """0 when the job completed, 130 when it was aborted (Ctrl-C), 1 otherwise."""
        if self.state is JobState.FINISHED_COMPLETED:
            return 0
        return 130 if self.state is JobState.FINISHED_ABORTED else 1


def resume_simulation(
    workspace: str | os.PathLike[str],
    out: IO[str] | None = None,
    verbose: bool = False,
    live: bool | None = None,
) -> SimulationResult:
    """Run a killed simulation again in its workspace: its job resumes from the last completed round.

    The job folder, the clients and the allowed folders are the run's (``run.json`` in the
    workspace); the server resumes each workflow from its checkpoint (workflows that completed
    are not run again); fresh keys are made; the summary covers the whole job.

    Raises:
        UsageError: The folder is not a simulator workspace, or its run already completed.
        ConfigError: The job folder no longer validates.
    """
    folder = Path(workspace).resolve()
    try:
        record = json.loads((folder / RUN_FILE).read_text(encoding="utf-8"))
        job_dir, clients = Path(record["job"]), [str(site) for site in record["clients"]]
        allowed = [Path(p) for p in record.get("allowed_dirs") or []]
        job_id = str(record["job_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"--resume {workspace}: not the workspace of a flengine run ({RUN_FILE} unreadable: {e})"
        ) from e
    previous, _ = server_result(folder)
    if previous is JobState.FINISHED_COMPLETED:
        raise UsageError(f"--resume {workspace}: that run completed; nothing to resume")
    paths = [str(job_dir), str(folder), *map(str, allowed)]
    launcher = Launcher(paths[0], command_line_room(paths, len(clients)))
    try:
        job = load_job(job_dir)
        insecure = _insecure(job, ["server", *clients])
        warnings = run_warnings(job, clients)
        for stale in (folder / "server" / "result.json", folder / SUMMARY_FILE):
            stale.unlink(missing_ok=True)  # the killed run's: this run writes its own
        shutil.rmtree(folder / KEYS_FOLDER, ignore_errors=True)  # throw-away keys: new ones
    except BaseException:
        launcher.close()
        raise
    run = _Run(job, clients, folder, job_id, out or sys.stdout, verbose, insecure, allowed, live, resume=True)
    run.launcher, run.warnings = launcher, warnings
    return run.execute()


def run_simulation(
    job_dir: str | os.PathLike[str],
    n_clients: int | None = None,
    workspace: str | os.PathLike[str] | None = None,
    out: IO[str] | None = None,
    verbose: bool = False,
    allowed_dirs: Sequence[str | os.PathLike[str]] = (),
    live: bool | None = None,
) -> SimulationResult:
    """Run a job with a server and ``n_clients`` client processes; return how it ended.

    Args:
        job_dir: The job folder (validated first; a bad job raises `ConfigError`).
        n_clients: How many clients (``site-1`` ..); the job's ``min_clients`` by default.
        workspace: Where logs, models and ``summary.json`` go; by default a new folder
            ``workspace/<job name>-<time>`` under the current folder. It must be new or empty.
        out: Where progress and the summary are printed (stdout by default).
        verbose: Debug logging in every process, whose log lines are shown too (on stderr, as
            ``site | line``; in a terminal above the live display), and the time of each stage
            of the run after the summary (``timing:``).
        allowed_dirs: Folders outside the workspace that the job's paths may name on every site
            (``download_to_disk_dir``, ``source_ckpt_file_full_name``): ``--allow-dir``. Without
            them a job's paths stay in the job folder and the workspace.
        live: The live display (a status line per site, a bar per download) above the lines of
            each round: None (default) where ``out`` is a terminal and rich is installed; False
            for the plain lines (one per round), as in a pipe (``--quiet``).
    """
    timings = RunTimings()
    out = out or sys.stdout
    allowed = [Path(folder).resolve() for folder in allowed_dirs]  # the processes run elsewhere
    # The launcher imports torch while this process validates the job (which imports its classes too).
    paths = [str(Path(job_dir).resolve()), str(Path(workspace or "workspace").resolve()), *map(str, allowed)]
    launcher = Launcher(paths[0], command_line_room(paths, n_clients or 0))
    try:
        job = load_job(job_dir)
        clients = _client_names(job, n_clients)
        insecure = _insecure(job, ["server", *clients])
        warnings = run_warnings(job, clients)
        folder = _prepare_workspace(job, workspace)
    except BaseException:
        launcher.close()
        raise
    run = _Run(job, clients, folder, folder.name, out, verbose, insecure, allowed, live)
    run.launcher, run.timings, run.warnings = launcher, timings, warnings
    return run.execute()


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


def _insecure(job: Job, sites: list[str]) -> bool:
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


def _client_names(job: Job, n_clients: int | None) -> list[str]:
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


def _side(site: str) -> str:
    return "server" if site == "server" else "client"


def _prepare_workspace(job: Job, workspace: str | os.PathLike[str] | None) -> Path:
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


class _Run:
    """One simulation: its processes, its events, its summary."""

    def __init__(
        self,
        job: Job,
        clients: list[str],
        folder: Path,
        job_id: str,
        out: IO[str],
        verbose: bool,
        insecure: bool,
        allowed_dirs: list[Path],
        live: bool | None = None,
        resume: bool = False,
    ) -> None:
        self.job = job
        self.resume = resume
        self.insecure = insecure
        self.allowed_dirs = allowed_dirs
        self.keys: dict[str, Path] = {}
        self.clients = clients
        self.folder = folder
        self.job_id = job_id
        self.out = out
        self.verbose = verbose
        self.states: list[dict[str, Any]] = []
        self.processes: dict[str, LaunchedProcess] = {}
        self.launcher: Launcher | None = None
        self.timings = RunTimings()
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.printer = make_printer(out, clients, live)
        self.follower: FileFollower | None = None
        self.started = time.monotonic()
        #: Said before the run starts and kept in summary.json (`run_warnings`).
        self.warnings: list[str] = []
        self._workflows_started = False

    def execute(self) -> SimulationResult:
        self._enter(JobState.SUBMITTED)
        again = " (resumed from its last completed round)" if self.resume else ""
        self.printer.line(f"job {self.job.name}: {len(self.clients)} clients, workspace {self.folder}{again}")
        self._record_run()
        if self.insecure:
            self.printer.line(INSECURE_WARNING)
        for warning in self.warnings:
            self.printer.line(f"warning: {warning}")
        state, reason = JobState.FINISHED_EXECUTION_EXCEPTION, ""
        interrupted = client_failed = False
        self.printer.start()
        try:
            if not self.insecure:  # removed in the finally below, whatever happens
                (self.folder / KEYS_FOLDER).mkdir(mode=0o700)
                self.keys = write_site_key_folders(self.folder / KEYS_FOLDER, "server", self.clients)
            state, reason = self._supervise()
        except _ServerFailed as e:
            state, reason = JobState.FINISHED_EXECUTION_EXCEPTION, str(e)
        except _ClientFailed as e:  # the server, stopped for it, would only say it was stopped
            state, reason = JobState.FINISHED_EXECUTION_EXCEPTION, str(e)
            client_failed = True
        except KeyboardInterrupt:
            self.printer.line("interrupted: stopping the job")
            state, reason = JobState.FINISHED_ABORTED, "interrupted (Ctrl-C)"
            interrupted = True
        finally:
            # Without the server's result no client will hear END_RUN: no point waiting for them.
            try:
                self._stop_all(interrupted or self._server_result()[0] is None)
                shutil.rmtree(self.folder / KEYS_FOLDER, ignore_errors=True)
            finally:
                self._stop_following()
                self.printer.close()  # the live display goes; the summary below stays
        result_state, result_reason = self._server_result()
        if state is not JobState.FINISHED_ABORTED and not client_failed and result_state is not None:
            state, reason = result_state, result_reason or reason
        self._enter(state)
        summary = self._write_summary(state, reason)
        for line in summary_table(summary):
            self.printer.line(line)
        for line in timing_lines(summary["timings"]) if self.verbose else []:
            self.printer.line(line)
        self.printer.line(report_hint(self.folder))
        if state is not JobState.FINISHED_COMPLETED and (self.folder / "server" / "checkpoint").is_dir():
            self.printer.line(f"resume: flengine run --resume {self.folder}  (from its last completed round)")
        return SimulationResult(state, self.folder, summary)

    def _record_run(self) -> None:
        """Write what a later ``flengine run --resume`` needs (`RUN_FILE`)."""
        record = {
            "job": str(self.job.folder.resolve()),
            "clients": self.clients,
            "job_id": self.job_id,
            "allowed_dirs": [str(folder) for folder in self.allowed_dirs],
        }
        (self.folder / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    def _enter(self, state: JobState) -> None:
        self.states.append({"state": state.value, "time": datetime.now().isoformat(timespec="seconds")})

    def _supervise(self) -> tuple[JobState, str]:
        server_extra = ["--clients", ",".join(self.clients), "--exit-notices", *(["--resume"] if self.resume else [])]
        commands = {"server": self._arguments("server", server_extra)}
        # The clients know the job's sites: a script's shard is its site's place in that list.
        client_extra = ["--connect", "-", "--clients", ",".join(self.clients)]
        commands.update({site: self._arguments(site, client_extra) for site in self.clients})
        assert self.launcher is not None
        for site, argv in commands.items():  # all at once: the clients build their executors meanwhile
            (self.folder / site).mkdir(parents=True, exist_ok=True)
            process = self.launcher.start(
                site,
                argv,
                self.folder / site,
                capture=site == "server",
                endpoint_pipe=site != "server",
                exit_notices=site == "server",
            )
            self.processes[site] = process
        server = self.processes["server"]
        threading.Thread(target=self._read_events, args=(server.stdout,), daemon=True).start()
        self.launcher.send_endpoint(self._wait_endpoint())
        self._enter(JobState.RUNNING)
        self._start_following()
        while True:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                event = {}
            if event is None:  # the server's stdout closed: it is exiting
                server.wait(STOP_GRACE_S)
                return self._server_result() if self._server_result()[0] else self._crashed("server")
            if event:
                self._workflows_started = self._workflows_started or event.get("event") == "workflow_started"
                self._show(event)
            self._check_clients()

    def _show(self, event: dict[str, Any]) -> None:
        if event.get("event") == LOG_LINE_EVENT:
            self.printer.log(str(event.get("site")), str(event.get("text")))
        else:
            self.printer.show(event)

    def _start_following(self) -> None:
        """Follow each client's events (for the live display) and, with ``-v``, every process's log."""
        self.follower = follow_run(
            self.folder, self.clients, self.events.put, events=isinstance(self.printer, LiveConsole), logs=self.verbose
        )

    def _stop_following(self) -> None:
        """Stop following; show the log lines still to show (the processes' last ones)."""
        if self.follower is None:
            return
        self.follower.stop()
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            if event and event.get("event") == LOG_LINE_EVENT:
                self._show(event)

    def _check_clients(self) -> None:
        """Show a client that exited with an error, with its last error lines; end the run if it is too early.

        Before the first workflow starts the server waits for every client, so a client that is
        gone makes the run end at once, instead of after the server's wait for clients. Once the
        workflows run, they decide (a dead client is one the job may do without).

        Raises:
            _ClientFailed: A client exited with an error before the first workflow started.
        """
        for site in self.clients:
            code = self.processes[site].poll()
            if code in (None, 0) or self.printer.noted(site):
                continue
            self.printer.show({"event": "process_exited", "site": site, "code": code})
            errors = self.folder / site / "stderr.txt"
            tail = error_tail(errors)
            when = "during the job" if self._workflows_started else "before the job started"
            log_file = self.folder / site / LOG_FILE
            self.printer.line(f"{site} exited with code {code} {when}; see {errors} and {log_file}")
            for line in tail:
                self.printer.line(f"  {site}: {line}")
            if not self._workflows_started:
                last = f": {' | '.join(tail)}" if tail else " (nothing on its stderr)"
                reason = f"the {site} process exited (code {code}) before the job started{last}; see {errors}"
                raise _ClientFailed(reason)

    def _wait_endpoint(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if event is None:
                raise _ServerFailed(self._crashed("server")[1])
            if event.get("event") == "listening" and "endpoint" in event:
                return str(event["endpoint"])
            self.printer.show(event)
        raise _ServerFailed(f"the server did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def _arguments(self, site: str, extra: list[str]) -> list[str]:
        """The arguments of ``python -m engine.runtime.entry`` for ``site`` (its parent: the launcher)."""
        role = "server" if site == "server" else "client"
        return [  # the role and the site first: they fit in ps whatever the paths (`command_line_room`)
            role, "--site", site, "--job", str(self.job.folder.resolve()), "--workspace", str(self.folder),
            "--job-id", self.job_id,
            *(["--insecure"] if self.insecure else ["--keys", str(self.keys[site])]),
            *(option for folder in self.allowed_dirs for option in ("--allow-dir", str(folder))),
            *extra, *(["--verbose"] if self.verbose else []),
        ]  # fmt: skip

    def _read_events(self, stream: IO[bytes]) -> None:
        for raw in stream:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if isinstance(event, dict):
                self.timings.from_event(event)
                self.events.put(event)
        self.events.put(None)

    def _stop_all(self, at_once: bool = False) -> None:
        """Let processes end by themselves, then terminate, then kill: none is left behind.

        On Ctrl-C, or when the server ended without a result, every process is told to stop at
        once (SIGTERM: the server aborts its workflow, a client abandons its task); otherwise
        clients get the time to hear END_RUN. Clients still waiting for the server's endpoint
        (it never listened) see their stdin close and exit.
        """
        if self.launcher is not None:
            self.launcher.stop_all(list(self.processes) if at_once else ["server"], STOP_GRACE_S, self.folder)
            if self.launcher.ready_at is not None:
                self.timings.mark("launcher_ready", self.launcher.ready_at)
        self.timings.mark("processes_exited")

    def _server_result(self) -> tuple[JobState | None, str]:
        return server_result(self.folder)

    def _crashed(self, site: str) -> tuple[JobState, str]:
        process = self.processes.get(site)
        code = process.poll() if process is not None else None
        if self.launcher is not None and not self.launcher.wait_ready(0.0):
            lines = [printable(line, ERROR_LINE_CHARS) for line in self.launcher.error_lines()[-ERROR_TAIL_LINES:]]
            tail = " | ".join(lines) or "nothing on its stderr"
            reason = f"the job processes could not start: {tail}; see {self.folder / LAUNCHER_ERRORS_FILE}"
            return JobState.FINISHED_EXECUTION_EXCEPTION, reason
        return (
            JobState.FINISHED_EXECUTION_EXCEPTION,
            f"the {site} process exited (code {code}) without a result; see {self.folder / site / 'stderr.txt'}",
        )

    def _write_summary(self, state: JobState, reason: str) -> dict[str, Any]:
        for site, at in client_ready_times(self.folder, self.clients).items():
            self.timings.client_ready(site, at)
        self.timings.mark("summary_written")
        fields = {
            "job": self.job.name,
            "job_id": self.job_id,
            "workspace": str(self.folder),
            "status": state.value,
            "reason": reason,
            "states": self.states,
            "clients": self.clients,
            "seconds": round(time.monotonic() - self.started, 2),
            "warnings": self.warnings,
            "timings": self.timings.to_summary(),
        }
        return write_summary(self.folder, fields, {site: p.returncode for site, p in self.processes.items()})


class _ServerFailed(Exception):
    pass


class _ClientFailed(Exception):
    """A client process exited with an error before the job started; the message is the run's reason."""
