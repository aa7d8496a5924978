"""The processes the simulator starts: ``python -m engine.runtime.entry server|client|worker ...``.

Each writes its log to ``<workspace>/<site>/log.txt``, its figures to ``process.json``, its memory
over time to ``rss.csv`` (`RssSampler`) and its progress events to ``events.jsonl``; the server
also writes its events as JSON lines on stdout and its outcome to ``result.json``.
A process exits when the process that started it goes away, so no orphan is left behind.

A client started with ``--connect -`` builds its executors first, then reads the server's endpoint
as one line on its stdin (the simulator's launcher writes it when the server listens; end of file
means the simulator is gone). A server started with ``--exit-notices`` reads the exits of its
clients' processes on its stdin, one JSON line each (``{"exited": SITE, "code": CODE}``, written by
the simulator's launcher or the server daemon): a client whose process ended is dead at once,
not after the heartbeat timeout. ``--clients`` names the job's client sites, in one order for
all: a server's clients, and a client's fellow sites (the Client API's ``get_site_index``).
A ``worker`` runs a simulation's virtual clients (`engine.runtime.worker`); ``--sites`` names the
plan file (`engine.runtime.workers.WorkerPlan`) that gives the job's clients and each worker's
share, for the server and the workers (10,000 names do not belong on a command line).
Once a process has written its result, its ``process.json`` and its
logs, it exits at once (`exit_now`): nothing is left to wait for, and the interpreter's teardown
of torch would only make the run end later.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from engine import fault_points
from engine.config import Job, load_job
from engine.errors import CellError, FlengineError, UsageError
from engine.fobs.tensor_pool import TENSOR_POOL
from engine.runtime.assembly import largest_chunk_bytes
from engine.runtime.client import ClientJob
from engine.runtime.process import (
    EVENTS_FILE,
    RESULT_FILE,
    EventWriter,
    exit_with_parent,
    log_to_file,
    mmap_threshold_for,
    return_freed_memory_to_the_system,
    write_process_file,
)
from engine.runtime.rss import RssSampler
from engine.runtime.server import ServerJob
from engine.runtime.states import JobState
from engine.runtime.worker import VirtualClientWorker
from engine.runtime.workers import WorkerPlan
from engine.site import INSECURE_WARNING, SiteSettings, cell_settings_of

log = logging.getLogger(__name__)

#: The ``--connect`` value of a client that reads the server's endpoint on its stdin.
ENDPOINT_FROM_STDIN = "-"
#: The longest endpoint line read from stdin, in bytes.
MAX_ENDPOINT_BYTES = 1024
#: The longest exit-notice line read from stdin, in bytes (longer ones are skipped).
MAX_NOTICE_BYTES = 4096
#: Seconds a client gets after SIGTERM to finish by itself.
STOP_GRACE_S = 5.0
#: The job's client sites (a JSON list), written by the server process into the run's workspace
#: for client processes that share it and were started without ``--clients`` (the simulator's).


def main(argv: Sequence[str] | None = None) -> int:
    """Run one server or client process of a job; return its exit code."""
    args = _parser().parse_args(argv)
    folder = Path(args.workspace) / args.site
    folder.mkdir(parents=True, exist_ok=True)
    log_to_file(folder, args.verbose)
    sampler = RssSampler(folder)
    sampler.start()
    try:
        return _run(args, folder)
    finally:
        sampler.stop()


def _run(args: argparse.Namespace, folder: Path) -> int:
    _on_signal(signal.SIGINT, signal.SIG_IGN)  # the simulator decides; it sends SIGTERM
    fault_points.set_site(args.site)
    job = load_job(args.job)
    chunk_bytes = largest_chunk_bytes(job)
    if return_freed_memory_to_the_system(chunk_bytes):
        threshold = mmap_threshold_for(chunk_bytes)
        log.debug("glibc mmap threshold %d bytes (largest chunk %d bytes)", threshold, chunk_bytes)
    try:
        plan = WorkerPlan.read(Path(args.sites)) if args.sites else None
        site = _site_settings(job, args, plan)
    except FlengineError as e:
        log.error("%s", e)
        print(f"Error: {args.site}: {e}", file=sys.stderr)
        return 1
    if args.role == "server":
        return _run_server(job, site, folder, args, plan)
    if args.role == "worker":
        return _run_worker(job, site, folder, args, plan)
    return _run_client(job, site, folder, args)


def _on_signal(signum: int, handler: Any) -> None:
    """Install a signal handler where this process's main thread runs us (not so in a Ray actor's call)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, handler)


def _site_settings(job: Job, args: argparse.Namespace, plan: WorkerPlan | None) -> SiteSettings:
    """This process's site: its name, its keys (or ``--insecure``), its app's cell settings, its ``--allow-dir``s.

    A worker's cell settings are its first client's app's.
    """
    if args.role == "worker" and (plan is None or args.site not in plan.workers):
        raise UsageError(f"a worker needs --sites, a plan that gives {args.site!r} its clients")
    app = job.app_for(plan.workers[args.site][0] if args.role == "worker" and plan is not None else args.site)
    document = None if app is None else (app.server if args.role == "server" else app.client)
    config = {} if document is None else document.data
    if args.insecure:
        log.warning("%s", INSECURE_WARNING)
    keys = Path(args.keys) if args.keys else None
    allowed = tuple(Path(folder) for folder in args.allow_dirs)
    cell = cell_settings_of(config)
    if args.host or args.port is not None:  # a daemon's job port, not the job's own cell settings
        port = cell.port if args.port is None else args.port
        cell = dataclasses.replace(cell, host=args.host or cell.host, port=port)
    site = SiteSettings(args.site, cell, keys, insecure=args.insecure, allowed_dirs=allowed)
    site.cell_security(server=args.role == "server")  # unsafe or missing keys fail here, at start
    return site


def _run_server(job: Job, site: SiteSettings, folder: Path, args: argparse.Namespace, plan: WorkerPlan | None) -> int:
    events = EventWriter(file=folder / EVENTS_FILE)
    clients = list(plan.clients) if plan is not None else _site_names(args.clients)
    workers = plan.workers if plan is not None else None
    server = ServerJob(job, site, folder, clients, args.job_id, events, resume=args.resume, workers=workers)
    parent = "the server daemon" if args.port is not None else "the simulator"  # a daemon gives the job's port
    _on_signal(signal.SIGTERM, lambda *_: server.abort(f"stopped by {parent} (SIGTERM)"))
    exit_with_parent(args.parent_pid, lambda: server.abort(f"{parent} went away"))
    if args.exit_notices:
        notices = (sys.stdin.buffer, server.client_exited, server.site_revoked)
        threading.Thread(target=read_site_notices, args=notices, daemon=True).start()
    started = time.time()
    warnings: list[str] = []
    try:
        outcome = server.run()
        state, reason, rounds, warnings = outcome.state, outcome.reason, outcome.rounds, outcome.warnings
    except Exception as e:
        log.exception("server job failed")
        state, reason, rounds = JobState.FINISHED_EXECUTION_EXCEPTION, f"{type(e).__name__}: {e}", server.rounds
    record = {
        "state": state.value,
        "reason": reason,
        "rounds": rounds,
        "warnings": warnings,
        "site_events": server.liveness.events,
        "seconds": time.time() - started,
    }
    (folder / RESULT_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    write_process_file(folder, args.site, chunks_served=server.chunks_served, tensor_pool=TENSOR_POOL.stats())
    events("job_done", state=state.value, reason=reason)
    events.close()
    return 0 if state is JobState.FINISHED_COMPLETED else 1


def _run_client(job: Job, site: SiteSettings, folder: Path, args: argparse.Namespace) -> int:
    events = EventWriter(file=folder / EVENTS_FILE, echo=False)
    job_sites = _site_names(args.clients)
    if job_sites and site.name not in job_sites:
        reason = f"--clients {args.clients} does not name this site; list every client site of the job"
        log.error("%s", reason)
        print(f"Error: {site.name}: {reason}", file=sys.stderr)
        return 1
    client = ClientJob(job, site, _endpoint_of(args, events), folder, args.job_id, report=events, job_sites=job_sites)
    code = _run_until_done(client, events, folder, args)
    write_process_file(
        folder,
        args.site,
        tasks_done=client.tasks_done,
        chunks_served=client.chunks_served,
        tensor_pool=TENSOR_POOL.stats(),
    )
    return code


def _run_worker(job: Job, site: SiteSettings, folder: Path, args: argparse.Namespace, plan: WorkerPlan | None) -> int:
    assert plan is not None  # `_site_settings` checked it
    events = EventWriter(file=folder / EVENTS_FILE, echo=False)
    clients, workspace = plan.workers[site.name], Path(args.workspace)
    worker = VirtualClientWorker(
        job, site, clients, _endpoint_of(args, events), workspace, args.job_id, plan.clients, report=events
    )
    code = _run_until_done(worker, events, folder, args)
    write_process_file(
        folder, args.site, turns=worker.turns, tasks_done=worker.tasks_done, tensor_pool=TENSOR_POOL.stats()
    )
    return code


def _endpoint_of(args: argparse.Namespace, events: EventWriter) -> str | Callable[[], str]:
    """``--connect``'s endpoint, or (``-``) a callable that reads it on stdin once its executors are built."""
    if args.connect == ENDPOINT_FROM_STDIN:
        return lambda: _endpoint_from_stdin(events)
    return str(args.connect)


def _run_until_done(
    runner: ClientJob | VirtualClientWorker, events: EventWriter, folder: Path, args: argparse.Namespace
) -> int:
    """Run a client's or a worker's loop until the run ends; stop on SIGTERM or when the parent goes; its exit code."""
    _on_signal(signal.SIGTERM, lambda *_: _stop_on_term(runner, folder, args.site))
    exit_with_parent(args.parent_pid, runner.abort_signal.set)
    code = 0
    try:
        runner.run()
    except _NoEndpoint as e:  # the run ended before the server listened: nothing to do
        log.info("%s", e)
    except Exception as e:
        log.exception("%s failed", args.role)
        print(f"Error: {args.site}: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    events.close()
    return code


def _endpoint_from_stdin(events: EventWriter) -> str:
    """The server's endpoint, one line on stdin; ``client_ready`` (executors built) is reported when it is asked for.

    Raises:
        _NoEndpoint: Stdin closed first (the client then exits with 0: it was never part of a run).
        CellError: The line is not an endpoint.
    """
    events("client_ready")
    line = sys.stdin.buffer.readline(MAX_ENDPOINT_BYTES)
    endpoint = line.decode("utf-8", errors="replace").strip()
    if not endpoint:
        raise _NoEndpoint("no server endpoint on stdin (--connect -): the run ended before the server listened")
    if not endpoint.startswith("tcp://"):
        raise CellError(f"--connect -: expected an endpoint tcp://HOST:PORT on stdin, got {endpoint[:80]!r}")
    log.debug("endpoint from stdin: %s", endpoint)
    return endpoint


def _site_names(listed: str) -> list[str]:
    """The names in a ``--clients`` value (comma-separated; empty: none)."""
    return [name for name in listed.split(",") if name]


class _NoEndpoint(CellError):
    """Stdin closed before the endpoint came: the server failed at start, or the simulator is gone."""


def exit_now(code: int) -> None:
    """End this process with ``code`` once its output is flushed, without the interpreter's teardown.

    Call it only after the process has written everything (result, ``process.json``, events):
    logging is shut down (files flushed and closed), stdout and stderr are flushed.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _stop_on_term(runner: ClientJob | VirtualClientWorker, folder: Path, site: str) -> None:
    """SIGTERM of a client or a worker: abandon the task, and exit after `STOP_GRACE_S` whatever the script does."""
    runner.abort_signal.set()

    def exit_late() -> None:
        write_process_file(folder, site, tasks_done=runner.tasks_done, stopped="SIGTERM")
        logging.shutdown()
        os._exit(143)

    timer = threading.Timer(STOP_GRACE_S, exit_late)
    timer.daemon = True
    timer.start()


def read_site_notices(
    stream: IO[bytes],
    client_exited: Callable[[str, int | None], None],
    site_revoked: Callable[[str], None] | None = None,
) -> None:
    """Call ``client_exited(site, code)`` for each exit notice of ``stream`` (``site_revoked(site)`` for each
    revocation) until it ends.

    A line that is not a notice (too long, not JSON, wrong types) is logged and skipped.
    """
    while True:
        line = stream.readline(MAX_NOTICE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_NOTICE_BYTES or not line.endswith(b"\n"):
            log.warning("exit notice skipped: longer than %d bytes", MAX_NOTICE_BYTES)
            while line and not line.endswith(b"\n"):  # the rest of that line
                line = stream.readline(MAX_NOTICE_BYTES + 1)
            continue
        try:
            notice = json.loads(line)
            if "revoked" in notice:
                site, code = notice["revoked"], None
            else:
                site, code = notice["exited"], notice.get("code")
            if not isinstance(site, str) or (code is not None and type(code) is not int):
                raise TypeError("site must be a string and code an integer")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("exit notice skipped: %s", e)
            continue
        if "revoked" in notice:
            if site_revoked is not None:
                site_revoked(site)
        else:
            client_exited(site, code)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.runtime.entry")
    parser.add_argument("role", choices=["server", "client", "worker"])
    parser.add_argument("--job", required=True, help="the job folder")
    parser.add_argument("--workspace", required=True, help="the job's workspace folder")
    parser.add_argument("--site", default="server", help="this process's site name")
    parser.add_argument("--job-id", default="job")
    parser.add_argument(
        "--clients",
        default="",
        help="the job's client sites, comma-separated, in one order for all (server: who takes part; client: "
        "what the Client API's get_site_index counts in)",
    )
    parser.add_argument(
        "--sites", default="", help="a worker plan file (sites.json): the job's clients and each worker's share"
    )
    parser.add_argument("--connect", default="", help="client: the server's endpoint; - to read it on stdin")
    parser.add_argument("--host", default="", help="server: the address to bind (instead of the job's cell.host)")
    parser.add_argument("--port", type=int, default=None, help="server: the port to bind (instead of cell.port)")
    parser.add_argument("--keys", default="", help="this site's keys folder (see engine.security.keys)")
    parser.add_argument("--insecure", action="store_true", help="no CURVE: plain TCP, unauthenticated")
    parser.add_argument(
        "--allow-dir",
        dest="allow_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help="an absolute folder outside the workspace that the job's paths may name (repeatable)",
    )
    parser.add_argument(
        "--exit-notices",
        action="store_true",
        help="server: read the exits of the clients' processes on stdin, one JSON line each",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="server: the job ran before and its server stopped: resume it from its checkpoint",
    )
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


if __name__ == "__main__":
    exit_now(main())
