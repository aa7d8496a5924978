"""`start`, `status` and `stop`: a POC's server and sites as background processes, each with a pid file."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine.deploy.folders import private_folder
from engine.deploy.pidfile import ProcessHandle, ProcessRecord, read_pid_file, write_pid_file
from engine.deploy.poc.folder import (
    Daemon,
    PocError,
    PocFolder,
    PocReport,
    admin_kit,
    prepared,
    read_daemons,
    read_kits,
    server_endpoint,
)
from engine.deploy.poc.prepare import check_ports_free
from engine.errors import FlengineError
from engine.provision import load_kit

#: Seconds `start` waits for the server to say it started.
SERVER_START_TIMEOUT_S = 30.0
#: Seconds `start` waits for every site to be connected once the server runs.
CONNECT_TIMEOUT_S = 60.0
#: Seconds `stop` gives the daemons after SIGTERM (each stops its job processes) before SIGKILL.
STOP_GRACE_S = 20.0
#: Seconds `stop` waits for a process to end after SIGKILL.
KILL_WAIT_S = 5.0
#: Seconds between two looks at a starting daemon's log or at the server's ``clients`` answer.
_POLL_INTERVAL_S = 0.2
_LOG_TAIL_LINES = 15


# --------------------------------------------------------------------------- start


def start(folder: Path) -> PocReport:
    """Start the server and every site of the POC that does not run yet; wait until every site is connected.

    Each daemon runs detached (a session of its own), its stdout and stderr in its workspace's
    ``daemon.txt``, its pid file in ``run/``. When a daemon fails to start or a site does not
    connect, the daemons this call started are stopped again and the error names the log to read.

    Returns:
        The POC's status; ``started`` names what this call started (empty when everything ran already).

    Raises:
        PocError: The POC is not prepared, its admin kit is missing, the server's ports are taken,
            or a daemon exited or did not connect in time.
        SecurityError: A kit was changed since it was provisioned.
    """
    poc = prepared(folder)
    kits = {kit.identity: kit for kit in read_kits(poc)}
    admin = admin_kit(poc)
    if admin is None:
        raise PocError(f"{poc.kits}: no admin kit; run `flengine poc prepare -d {folder}` again")
    daemons = [d for d in read_daemons(poc) if d.name in kits]
    to_start = [d for d in daemons if d.state != "running"]
    if not to_start:
        return dataclasses.replace(status(folder), started=())
    for daemon in to_start:
        load_kit(poc.kit(daemon.name))  # a tampered kit stops everything before anything starts
        poc.pid_file(daemon.name).unlink(missing_ok=True)
    private_folder(poc.run)
    started: list[_Started] = []
    try:
        server = next((d for d in to_start if d.kind == "server"), None)
        if server is not None:
            kit = kits[server.name]
            check_ports_free(kit.server.bind_host, kit.server.port, poc, "start")
            started.append(_spawn(poc, server))
            _wait_started(started[-1], SERVER_START_TIMEOUT_S)
        started += [_spawn(poc, d) for d in to_start if d.kind == "site"]
        sites = [d.name for d in daemons if d.kind == "site"]
        _wait_connected(admin, sites, started, CONNECT_TIMEOUT_S)
    except BaseException:
        _stop_started(poc, started)
        raise
    return dataclasses.replace(status(folder), started=tuple(s.daemon.name for s in started))


@dataclasses.dataclass
class _Started:
    """A daemon this `start` spawned: its process and where its log began."""

    daemon: Daemon
    process: subprocess.Popen[bytes]
    log_offset: int


def _spawn(poc: PocFolder, daemon: Daemon) -> _Started:
    workspace = poc.workspace(daemon.name).resolve()
    private_folder(workspace)
    role = "server" if daemon.kind == "server" else "client"
    command = [sys.executable, "-m", "engine", role, "start", str(poc.kit(daemon.name).resolve())]
    command += ["--workspace", str(workspace)]
    log_file = poc.log(daemon.name)
    with log_file.open("ab") as out:
        offset = out.tell()
        process = subprocess.Popen(
            command,  # in this command's folder and environment, so `-m engine` imports as it did here
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        record = ProcessRecord.of(process.pid, daemon.name, daemon.kind, command)
    except ProcessLookupError:
        process.wait()
        raise PocError(f"{daemon.name} exited at once:\n{_tail(log_file, offset)}") from None
    write_pid_file(poc.pid_file(daemon.name), record)
    return _Started(dataclasses.replace(daemon, state="running", pid=process.pid), process, offset)


def _wait_started(started: _Started, timeout_s: float) -> None:
    """Wait until the daemon's log says it started (the line ``... started; workspace ...``)."""
    log_file = started.daemon.log
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if " started; workspace " in _read_from(log_file, started.log_offset):
            return
        _check_alive(started)
        time.sleep(_POLL_INTERVAL_S)
    raise PocError(f"{started.daemon.name} did not start within {timeout_s:g} s; see {log_file}")


def _wait_connected(admin_kit: Path, sites: list[str], started: list[_Started], timeout_s: float) -> None:
    """Wait until the server's ``clients`` answer says every site is connected."""
    from engine.deploy.admin import AdminSession

    deadline = time.monotonic() + timeout_s
    missing = list(sites)
    with AdminSession(load_kit(admin_kit)) as session:
        while time.monotonic() < deadline:
            answer = session.command("clients", timeout_s=max(1.0, deadline - time.monotonic()))
            connected = {entry["site"] for entry in answer if entry["connected"]}
            missing = [site for site in sites if site not in connected]
            if not missing:
                return
            for one in started:
                _check_alive(one)
            time.sleep(_POLL_INTERVAL_S)
    logs = ", ".join(str(one.daemon.log) for one in started if one.daemon.name in missing)
    raise PocError(
        f"{', '.join(missing)} did not connect to the server within {timeout_s:g} s"
        + (f"; see {logs}" if logs else "; it was running already: see `flengine poc status`")
    )


def _check_alive(started: _Started) -> None:
    code = started.process.poll()
    if code is not None:
        raise PocError(
            f"{started.daemon.name} exited with code {code} while starting; its output "
            f"({started.daemon.log}):\n{_tail(started.daemon.log, started.log_offset)}"
        )


def _read_from(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as source:
            source.seek(offset)
            return source.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _tail(path: Path, offset: int) -> str:
    lines = _read_from(path, offset).splitlines()[-_LOG_TAIL_LINES:]
    return "\n".join(f"  {line}" for line in lines) or "  (no output)"


def _stop_started(poc: PocFolder, started: list[_Started]) -> None:
    """Stop what a failed `start` started (sites first), leaving no pid file behind."""
    for one in reversed(started):
        if one.process.poll() is None:
            one.process.terminate()
            try:
                one.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                one.process.kill()
                one.process.wait(KILL_WAIT_S)
        poc.pid_file(one.daemon.name).unlink(missing_ok=True)


# --------------------------------------------------------------------------- status


def status(folder: Path) -> PocReport:
    """What runs of the POC in ``folder`` and, when the server runs, its ``clients`` answer.

    Raises:
        PocError: ``folder`` holds no prepared POC.
    """
    poc = prepared(folder)
    daemons = read_daemons(poc)
    admin = admin_kit(poc)
    server = next((d for d in daemons if d.kind == "server"), None)
    server_error = None
    if server is not None and server.state == "running" and admin is not None:
        try:
            sites = {entry["site"]: entry for entry in _clients(admin)}
        except FlengineError as e:
            sites, server_error = {}, str(e)
        daemons = [dataclasses.replace(d, site=sites.get(d.name, {})) if d.kind == "site" else d for d in daemons]
    return PocReport(folder, server_endpoint(poc), tuple(daemons), admin, server_error=server_error)


def _clients(kit: Path) -> list[dict[str, Any]]:
    from engine.deploy.admin import AdminSession  # zmq loads only where the server is asked

    with AdminSession(load_kit(kit)) as session:
        return list(session.command("clients", timeout_s=10.0))


# --------------------------------------------------------------------------- stop


def stop(folder: Path, grace_s: float = STOP_GRACE_S) -> PocReport:
    """End exactly the processes `start` started: the sites first, then the server; remove the pid files.

    A pid file whose process has ended, or whose pid belongs to another process now, is removed
    and nothing is signalled. Each daemon gets SIGTERM, then SIGKILL after ``grace_s`` seconds.

    Returns:
        One daemon per pid file found, with state ``stopped``, ``killed``, ``stale`` or
        ``still running`` (its pid file is kept); no daemons when nothing ran.

    Raises:
        PocError: ``folder`` is not a POC folder.
    """
    poc = PocFolder(folder)
    if not folder.is_dir():
        raise PocError(f"{folder}: no such folder; give -d the POC folder that `flengine poc prepare` wrote")
    daemons = [d for d in read_daemons(poc) if d.state != "stopped"]
    results = {d.name: d for d in daemons if d.state == "stale"}
    for group in ([d for d in daemons if d.kind != "server"], [d for d in daemons if d.kind == "server"]):
        results.update(_end(poc, [d for d in group if d.state == "running"], grace_s))
    for daemon in results.values():
        if daemon.state != "still running":
            poc.pid_file(daemon.name).unlink(missing_ok=True)
    in_stop_order = sorted(daemons, key=lambda d: d.kind == "server")
    return PocReport(folder, server_endpoint(poc), tuple(results[d.name] for d in in_stop_order))


def _end(poc: PocFolder, daemons: list[Daemon], grace_s: float) -> dict[str, Daemon]:
    """SIGTERM each daemon, wait for all up to ``grace_s``, SIGKILL those left; their end states."""
    handles: dict[str, ProcessHandle] = {}
    states: dict[str, str] = {}
    for daemon in daemons:
        try:
            record = read_pid_file(poc.pid_file(daemon.name))
        except (OSError, ValueError):
            states[daemon.name] = "stale"
            continue
        handle = ProcessHandle.open(record)
        if handle is None or not handle.signal(signal.SIGTERM):
            states[daemon.name] = "stale" if handle is None else "stopped"
            if handle is not None:
                handle.close()
            continue
        handles[daemon.name] = handle
    deadline = time.monotonic() + grace_s
    for name, handle in handles.items():
        if handle.wait(deadline - time.monotonic()):
            states[name] = "stopped"
        else:
            handle.signal(signal.SIGKILL)
            states[name] = "killed" if handle.wait(KILL_WAIT_S) else "still running"
        handle.close()
    return {d.name: dataclasses.replace(d, state=states[d.name]) for d in daemons}
