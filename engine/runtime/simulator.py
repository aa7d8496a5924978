"""The simulator behind ``flengine run``: a server process and N client processes on this machine.

It has the server and ``site-1`` .. ``site-N`` forked at once by one launcher process that
imported torch once (`engine.runtime.launcher`), or, with ``workers`` (``-t W``), the server and
W worker processes that run the N clients as virtual clients (`engine.runtime.worker`; a worker
that dies is started again, `MAX_WORKER_RESTARTS` times), gives the clients the server's
endpoint when it listens, shows the server's progress events as they come, and stops everything on success, on
failure and on Ctrl-C. At the end it writes ``<workspace>/summary.json`` (states, rounds,
per-process peak RSS, the time of each stage of the run: `engine.runtime.timings`) and prints a
summary table (with ``-v``, the stage times too).
"""

from __future__ import annotations

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
from engine.errors import FlengineError, UsageError
from engine.runtime.follow import LOG_LINE_EVENT, FileFollower, follow_run
from engine.runtime.launcher import LAUNCHER_ERRORS_FILE, LaunchedProcess, Launcher, command_line_room
from engine.runtime.live import LiveConsole, make_printer
from engine.runtime.process import LOG_FILE
from engine.runtime.progress import summary_table
from engine.runtime.run_setup import (
    ERROR_LINE_CHARS,
    ERROR_TAIL_LINES,
    RunRecord,
    client_names,
    error_tail,
    insecure_run,
    prepare_workspace,
    report_hint,
    worker_plan,
)
from engine.runtime.run_setup import RUN_FILE as RUN_FILE  # where run.json is named, for callers
from engine.runtime.run_warnings import run_warnings
from engine.runtime.states import JobState
from engine.runtime.summary import SUMMARY_FILE as SUMMARY_FILE  # where summary.json is named, for callers
from engine.runtime.summary import client_ready_times, server_result, write_summary
from engine.runtime.timings import RunTimings, timing_lines
from engine.runtime.workers import WorkerPlan
from engine.security import write_site_key_folders
from engine.site import INSECURE_WARNING
from engine.text import printable

log = logging.getLogger(__name__)

#: The run's throw-away keys, under its workspace; removed when the run ends.
KEYS_FOLDER = "keys"
#: Seconds to wait for the server to report its endpoint.
STARTUP_TIMEOUT_S = 60.0
#: Seconds processes get to exit by themselves before they are terminated, then killed.
STOP_GRACE_S = 20.0
#: Times a worker of virtual clients that died is started again before the run does without it.
MAX_WORKER_RESTARTS = 3


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
    record = RunRecord.read(folder)
    clients, allowed = record.clients, record.allowed_dirs
    previous, _ = server_result(folder)
    if previous is JobState.FINISHED_COMPLETED:
        raise UsageError(f"--resume {workspace}: that run completed; nothing to resume")
    paths = [str(record.job), str(folder), *map(str, allowed)]
    launcher = Launcher(paths[0], command_line_room(paths, 0 if record.workers else len(clients)))
    try:
        job = load_job(record.job)
        plan = worker_plan(job, clients, record.workers)
        insecure = insecure_run(job, ["server", *clients])
        warnings = run_warnings(job, clients)
        for stale in (folder / "server" / "result.json", folder / SUMMARY_FILE):
            stale.unlink(missing_ok=True)  # the killed run's: this run writes its own
        shutil.rmtree(folder / KEYS_FOLDER, ignore_errors=True)  # throw-away keys: new ones
    except BaseException:
        launcher.close()
        raise
    out = out or sys.stdout
    run = _Run(job, clients, folder, record.job_id, out, verbose, insecure, allowed, live, resume=True, plan=plan)
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
    workers: int | None = None,
    backend: Any = None,
) -> SimulationResult:
    """Run a job with a server and ``n_clients`` client processes (or virtual clients); return how it ended.

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
        workers: Run the clients as virtual clients on this many worker processes (``-t``), one
            client's task at a time per worker; None: one process per client.
        backend: Where the workers run with ``workers``: None for processes of this machine, or
            a `engine.runtime.ray_backend.RayWorkers` (``--backend ray``).
    """
    timings = RunTimings()
    out = out or sys.stdout
    allowed = [Path(folder).resolve() for folder in allowed_dirs]  # the processes run elsewhere
    # The launcher imports torch while this process validates the job (which imports its classes too).
    paths = [str(Path(job_dir).resolve()), str(Path(workspace or "workspace").resolve()), *map(str, allowed)]
    launcher = Launcher(paths[0], command_line_room(paths, 0 if workers else n_clients or 0))
    try:
        job = load_job(job_dir)
        clients = client_names(job, n_clients)
        plan = worker_plan(job, clients, workers)
        insecure = insecure_run(job, ["server", *clients])
        warnings = run_warnings(job, clients)
        folder = prepare_workspace(job, workspace)
    except BaseException:
        launcher.close()
        raise
    run = _Run(job, clients, folder, folder.name, out, verbose, insecure, allowed, live, plan=plan, backend=backend)
    run.launcher, run.timings, run.warnings = launcher, timings, warnings
    return run.execute()


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
        plan: WorkerPlan | None = None,
        backend: Any = None,
    ) -> None:
        self.job = job
        self.resume = resume
        self.plan = plan
        self.backend = backend
        #: The client processes: the clients, or the workers that run them as virtual clients.
        self.runners = list(plan.workers) if plan is not None else clients
        self.restarts: dict[str, int] = {}
        self.endpoint = ""
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
        self.printer = make_printer(out, self.runners, live)
        self.follower: FileFollower | None = None
        self.started = time.monotonic()
        #: Said before the run starts and kept in summary.json (`run_warnings`).
        self.warnings: list[str] = []
        self._workflows_started = False

    def execute(self) -> SimulationResult:
        self._enter(JobState.SUBMITTED)
        again = " (resumed from its last completed round)" if self.resume else ""
        on = f" on {len(self.runners)} workers" if self.plan is not None else ""
        self.printer.line(f"job {self.job.name}: {len(self.clients)} clients{on}, workspace {self.folder}{again}")
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
                self.keys = write_site_key_folders(self.folder / KEYS_FOLDER, "server", self.runners)
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
        """Write what a later ``flengine run --resume`` needs (`RunRecord`)."""
        workers = len(self.runners) if self.plan is not None else None
        RunRecord(self.job.folder.resolve(), self.clients, self.job_id, self.allowed_dirs, workers).write(self.folder)

    def _enter(self, state: JobState) -> None:
        self.states.append({"state": state.value, "time": datetime.now().isoformat(timespec="seconds")})

    def _supervise(self) -> tuple[JobState, str]:
        # The clients know the job's sites: a script's shard is its site's place in that list.
        if self.plan is not None:  # 10,000 names go in a file, not on command lines
            sites = ["--sites", str(self.plan.write(self.folder))]
        else:
            sites = ["--clients", ",".join(self.clients)]
        server_extra = [*sites, "--exit-notices", *(["--resume"] if self.resume else [])]
        commands = {"server": self._arguments("server", server_extra)}
        if self.backend is None:
            commands.update({site: self._arguments(site, ["--connect", "-", *sites]) for site in self.runners})
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
        self.endpoint = self._wait_endpoint()
        self.launcher.send_endpoint(self.endpoint)
        if self.backend is not None:  # Ray actors: started once the server listens, told where
            self.backend.open(len(self.runners), self.job.meta.data.get("resource_spec", {}))
            for site in self.runners:
                (self.folder / site).mkdir(parents=True, exist_ok=True)
                self.processes[site] = self.backend.start(
                    site, self._arguments(site, ["--connect", self.endpoint, *sites])
                )
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
            self.folder, self.runners, self.events.put, events=isinstance(self.printer, LiveConsole), logs=self.verbose
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
        for site in self.runners:
            code = self.processes[site].poll()
            if code in (None, 0) or self.printer.noted(site):
                continue
            if self.backend is not None and self.launcher is not None:  # the launcher tells of its own children only
                self.launcher.tell_exit(site, code)
            if self.plan is not None and self._workflows_started and self._restart_worker(site, code):
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

    def _restart_worker(self, site: str, code: int) -> bool:
        """Start a worker that died again (its clients' tasks fail as a client's death would); False past the limit."""
        done = self.restarts.get(site, 0)
        if done >= MAX_WORKER_RESTARTS:
            return False
        self.restarts[site] = done + 1
        self.printer.line(f"{site} exited with code {code}; starting it again ({done + 1} of {MAX_WORKER_RESTARTS})")
        sites = ["--sites", str(self.folder / "sites.json")]
        argv = self._arguments(site, ["--connect", self.endpoint, *sites])
        if self.backend is not None:
            self.processes[site] = self.backend.start(site, argv)
        else:
            assert self.launcher is not None
            self.processes[site] = self.launcher.start(site, argv, self.folder / site, capture=False)
        return True

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
        role = "server" if site == "server" else "worker" if self.plan is not None else "client"
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
        if self.backend is not None:  # the workers end when the server does; Ray actors are ended here
            self.backend.stop_all(0.0 if at_once else STOP_GRACE_S)
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
        for site, at in client_ready_times(self.folder, self.runners).items():
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
            **({"workers": len(self.runners), "worker_restarts": self.restarts} if self.plan is not None else {}),
            "seconds": round(time.monotonic() - self.started, 2),
            "warnings": self.warnings,
            "timings": self.timings.to_summary(),
        }
        return write_summary(self.folder, fields, {site: p.returncode for site, p in self.processes.items()})


class _ServerFailed(FlengineError):
    pass


class _ClientFailed(FlengineError):
    """A client process exited with an error before the job started; the message is the run's reason."""
