"""The ``flengine server``, ``flengine client`` and ``flengine admin`` commands: arguments to daemons and sessions.

``server start`` and ``client start`` run in the foreground until SIGTERM or Ctrl-C (or an
admin's ``shutdown``); their log goes to ``<workspace>/log.txt`` and one line per start and stop
to stdout. ``admin`` runs one command and prints its answer, as text or (``--format json``) as
one JSON document; it exits 0 when the command succeeded and 1 when the server refused it.
``admin watch JOB`` and ``admin logs JOB --follow`` show the job live until it has ended
(`engine.deploy.watch`), then exit 0 when it finished completed and 1 otherwise.
Text from peers (log lines of sites, job names, reasons) is printed with its control characters
escaped (`printable`), so a site cannot send escape sequences to the admin's terminal.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.deploy.folders import private_folder
from engine.deploy.reach import check_reachable
from engine.provision import Kit, load_kit
from engine.text import printable

if TYPE_CHECKING:  # loaded only once the server answered (it loads torch)
    from engine.deploy.admin import AdminSession

log = logging.getLogger(__name__)


def default_workspace(kit: Kit) -> Path:
    """``<kit's parent>/<identity>-workspace``: next to the kit, never inside it (the manifest covers the kit)."""
    return kit.folder.resolve().parent / f"{kit.identity}-workspace"


def run_server(kit_folder: str, workspace: str | None, verbose: bool = False) -> int:
    """``flengine server start KIT``: run the server daemon until stopped; return the exit code."""
    from engine.deploy.server import ServerDaemon

    kit = load_kit(kit_folder)
    folder = Path(workspace) if workspace else default_workspace(kit)
    _log_to(folder, verbose)
    daemon = ServerDaemon(kit, folder)
    return _serve(daemon, f"server of project {kit.project}", folder)


def run_client(kit_folder: str, workspace: str | None, verbose: bool = False) -> int:
    """``flengine client start KIT``: run a site's client daemon until stopped; return the exit code."""
    from engine.deploy.client import ClientDaemon

    kit = load_kit(kit_folder)
    folder = Path(workspace) if workspace else default_workspace(kit)
    _log_to(folder, verbose)
    daemon = ClientDaemon(kit, folder)
    return _serve(daemon, f"client {kit.identity} of project {kit.project}", folder)


def _serve(daemon: Any, what: str, folder: Path) -> int:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    daemon.start()
    print(f"{what} started; workspace {folder}; log {folder / 'log.txt'}", flush=True)
    watcher = threading.Thread(target=lambda: (daemon.stopped.wait(), stop.set()), daemon=True)
    watcher.start()
    while not stop.wait(0.5):  # signals reach the main thread between waits
        pass
    daemon.stop("stopped by a signal" if not daemon.stopped.is_set() else "shutdown")
    print(f"{what} stopped", flush=True)
    return 0


def _log_to(folder: Path, verbose: bool) -> None:
    from engine.runtime.process import log_to_file

    private_folder(folder)
    log_to_file(folder, verbose)


def run_admin(
    kit_folder: str, command: str, args: list[str], output: str | None, fmt: str, follow: bool = False
) -> int:
    """``flengine admin KIT COMMAND [ARGS]``: run one command, print its answer; return the exit code.

    ``watch JOB``, and ``logs JOB [SITE]`` with ``follow``, show the job live until it has
    ended (`engine.deploy.watch`) and exit 0 only when it finished completed.
    """
    if follow and command != "logs":
        raise _usage(f"--follow goes with logs only (flengine admin KIT logs JOB_ID --follow), not with {command}")
    kit = load_kit(kit_folder)
    # before the session's modules load (about a second): a dead server fails at once
    check_reachable(kit.server.host, kit.server.port)
    from engine.deploy.admin import AdminSession

    with AdminSession(kit) as session:
        if command == "watch" or follow:
            return _watch(session, command, args, fmt)
        if command == "submit":
            answer = session.submit(Path(_one(command, args, "JOB_FOLDER")))
        elif command == "download":
            folder = session.download(_one(command, args, "JOB_ID"), Path(output or "."))
            answer = {"job_id": args[0], "folder": str(folder)}
        elif command == "logs":
            if not 1 <= len(args) <= 2:
                raise _usage(f"flengine admin KIT logs JOB_ID [SITE]: expected 1 or 2 arguments, got {len(args)}")
            answer = session.command(command, job_id=args[0], site=args[1] if len(args) == 2 else "")
        elif command in ("status", "abort", "delete"):
            answer = session.command(command, job_id=_one(command, args, "JOB_ID"))
        elif command in ("list", "clients"):
            _none(command, args)
            answer = session.command(command)
        elif command == "shutdown":
            answer = session.command(command, target=args[0] if args else "server")
        else:
            raise _usage(f"unknown admin command {command!r}")
    if fmt == "json":
        print(json.dumps(answer, indent=2, default=str))
    else:
        _print_text(command, answer)
    return 0


def _watch(session: AdminSession, command: str, args: list[str], fmt: str) -> int:
    """``watch JOB`` or ``logs JOB [SITE] --follow``: the job live until it has ended; the exit code."""
    from engine.deploy.watch import follow_log, watch_job

    if command == "watch":
        return watch_job(session, _one(command, args, "JOB_ID"), fmt)
    if not 1 <= len(args) <= 2:
        raise _usage(f"flengine admin KIT logs JOB_ID [SITE] --follow: expected 1 or 2 arguments, got {len(args)}")
    return follow_log(session, args[0], args[1] if len(args) == 2 else "", fmt)


def _one(command: str, args: list[str], what: str) -> str:
    if len(args) != 1:
        raise _usage(f"flengine admin KIT {command} {what}: expected one {what}, got {len(args)} arguments")
    return args[0]


def _none(command: str, args: list[str]) -> None:
    if args:
        raise _usage(f"flengine admin KIT {command}: takes no arguments, got {' '.join(args)}")


def _usage(message: str) -> Exception:
    from engine.errors import UsageError

    return UsageError(message)


def _say(text: str) -> None:
    """Print one line of the answer, peer text made `printable`."""
    print(printable(text), file=sys.stdout)


def _print_text(command: str, answer: Any) -> None:
    if command == "submit":
        _say(f"submitted: {answer['job_id']} ({answer['name']})")
    elif command == "list":
        if not answer:
            _say("no jobs")
        else:
            _say(f"{'job id':<12}  {'status':<28} {'name':<16} {'submitter':<12} submitted at")
        for job in answer:
            _say(f"{job['job_id']}  {job['status']:<28} {job['name']:<16} {job['submitter']:<12} {job['submitted_at']}")
    elif command in ("status", "abort"):
        for key in ("job_id", "name", "status", "submitter", "submitter_org", "sites", "port", "submitted_at",
                    "started_at", "finished_at", "reason", "waiting", "results_pending"):  # fmt: skip
            if answer.get(key) not in (None, "", []):
                _say(f"{key:<15} {_field_text(answer[key])}")
    elif command == "delete":
        _say(f"deleted: {answer['job_id']}")
    elif command == "logs":
        for line in answer["lines"]:  # one line each: a newline inside a line is escaped
            _say(line)
    elif command == "clients":
        if answer:
            _say(f"{'site':<12} {'org':<16} {'state':<34} jobs")
        for site in answer:
            state = (
                f"connected, last status {site['last_status_s']:.1f} s ago" if site["connected"] else "not connected"
            )
            jobs = ", ".join(site["jobs"]) or "-"
            _say(f"{site['site']:<12} {site['org']:<16} {state:<34} {jobs}")
    elif command == "download":
        _say(f"downloaded to {answer['folder']}")
    elif command == "shutdown":
        target = answer.get("shutdown")
        if target == "all":
            _say("shutting down: every connected site, then the server")
        else:
            _say(f"shutting down: {'the server' if target == 'server' else target}")
    elif isinstance(answer, dict):
        for key, value in answer.items():
            _say(f"{key:<15} {_field_text(value)}")
    else:
        _say(_field_text(answer))


def _field_text(value: Any) -> str:
    """A value of an answer as text: a list as ``a, b``, not as Python writes it."""
    if isinstance(value, (list, tuple)):
        return ", ".join(_field_text(item) for item in value)
    if isinstance(value, dict):
        return ", ".join(f"{key}={_field_text(item)}" for key, item in value.items())
    return str(value)
