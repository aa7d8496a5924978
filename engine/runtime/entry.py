"""The processes the simulator starts: ``python -m engine.runtime.entry server|client ...``.

Each writes its log to ``<workspace>/<site>/log.txt``, its figures to ``process.json``, its memory
over time to ``rss.csv`` (`RssSampler`) and its progress events to ``events.jsonl``; the server
also writes its events as JSON lines on stdout and its outcome to ``result.json``.
A process exits when the process that started it goes away, so no orphan is left behind.

A client started with ``--connect -`` builds its executors first, then reads the server's endpoint
as one line on its stdin (the simulator's launcher writes it when the server listens; end of file
means the simulator is gone). Once a process has written its result, its ``process.json`` and its
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

from engine.config import Job, load_job
from engine.errors import CellError, FlengineError
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
from engine.site import INSECURE_WARNING, SiteSettings, cell_settings_of

log = logging.getLogger(__name__)

#: The ``--connect`` value of a client that reads the server's endpoint on its stdin.
ENDPOINT_FROM_STDIN = "-"
#: The longest endpoint line read from stdin, in bytes.
MAX_ENDPOINT_BYTES = 1024
#: Seconds a client gets after SIGTERM to finish by itself.
STOP_GRACE_S = 5.0


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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the simulator decides; it sends SIGTERM
    job = load_job(args.job)
    chunk_bytes = largest_chunk_bytes(job)
    if return_freed_memory_to_the_system(chunk_bytes):
        threshold = mmap_threshold_for(chunk_bytes)
        log.debug("glibc mmap threshold %d bytes (largest chunk %d bytes)", threshold, chunk_bytes)
    try:
        site = _site_settings(job, args)
    except FlengineError as e:
        log.error("%s", e)
        print(f"Error: {args.site}: {e}", file=sys.stderr)
        return 1
    if args.role == "server":
        return _run_server(job, site, folder, args)
    return _run_client(job, site, folder, args)


def _site_settings(job: Job, args: argparse.Namespace) -> SiteSettings:
    """This process's site: its name, its keys (or ``--insecure``), its app's cell settings, its ``--allow-dir``s."""
    app = job.app_for(args.site)
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


def _run_server(job: Job, site: SiteSettings, folder: Path, args: argparse.Namespace) -> int:
    events = EventWriter(file=folder / EVENTS_FILE)
    server = ServerJob(job, site, folder, args.clients.split(","), args.job_id, events)
    signal.signal(signal.SIGTERM, lambda *_: server.abort("stopped by the simulator (SIGTERM)"))
    exit_with_parent(args.parent_pid, lambda: server.abort("the simulator went away"))
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
        "seconds": time.time() - started,
    }
    (folder / RESULT_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    write_process_file(folder, args.site, chunks_served=server.chunks_served, tensor_pool=TENSOR_POOL.stats())
    events("job_done", state=state.value, reason=reason)
    events.close()
    return 0 if state is JobState.FINISHED_COMPLETED else 1


def _run_client(job: Job, site: SiteSettings, folder: Path, args: argparse.Namespace) -> int:
    events = EventWriter(file=folder / EVENTS_FILE, echo=False)
    endpoint: str | Callable[[], str] = args.connect
    if args.connect == ENDPOINT_FROM_STDIN:
        endpoint = lambda: _endpoint_from_stdin(events)  # noqa: E731 (called once its executors are built)
    client = ClientJob(job, site, endpoint, folder, args.job_id, report=events)
    signal.signal(signal.SIGTERM, lambda *_: _stop_client(client, folder, args.site))
    exit_with_parent(args.parent_pid, client.abort_signal.set)
    code = 0
    try:
        client.run()
    except _NoEndpoint as e:  # the run ended before the server listened: this client has nothing to do
        log.info("%s", e)
    except Exception as e:
        log.exception("client job failed")
        print(f"Error: {args.site}: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    events.close()
    write_process_file(
        folder,
        args.site,
        tasks_done=client.tasks_done,
        chunks_served=client.chunks_served,
        tensor_pool=TENSOR_POOL.stats(),
    )
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


def _stop_client(client: ClientJob, folder: Path, site: str) -> None:
    """SIGTERM: abandon the task; a training script that does not return in time cannot hold the exit."""
    client.abort_signal.set()

    def exit_late() -> None:
        write_process_file(folder, site, tasks_done=client.tasks_done, stopped="SIGTERM")
        logging.shutdown()
        os._exit(143)

    timer = threading.Timer(STOP_GRACE_S, exit_late)
    timer.daemon = True
    timer.start()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.runtime.entry")
    parser.add_argument("role", choices=["server", "client"])
    parser.add_argument("--job", required=True, help="the job folder")
    parser.add_argument("--workspace", required=True, help="the job's workspace folder")
    parser.add_argument("--site", default="server", help="this process's site name")
    parser.add_argument("--job-id", default="job")
    parser.add_argument("--clients", default="", help="server: comma-separated client names")
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
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


if __name__ == "__main__":
    exit_now(main())
