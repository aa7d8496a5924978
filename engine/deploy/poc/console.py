"""The ``flengine poc`` commands: arguments to `engine.deploy.poc`, its reports to text or JSON.

Every command takes the POC folder (``./poc`` by default) and ``--format text|json``. ``status``
exits 0 when every daemon runs and every site is connected, 1 otherwise; ``stop`` exits 1 when a
process outlived SIGKILL; the others exit 0 when they did what was asked.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from engine.deploy.poc import DEFAULT_FOLDER, Daemon, PocReport, PrepareReport, prepare, start, status, stop


def run_poc(action: str, folder: str | None, fmt: str, sites: int | None = None, port: int | None = None) -> int:
    """``flengine poc ACTION``: run one POC command, print its report; return the exit code."""
    where = Path(folder) if folder else DEFAULT_FOLDER
    if action == "prepare":
        prepared = prepare(where, sites, port)
        _print(prepared.to_json() if fmt == "json" else _prepare_text(where, prepared))
        return 0
    if action == "start":
        report = start(where)
        _print(report.to_json() if fmt == "json" else _start_text(report))
        return 0
    if action == "status":
        report = status(where)
        _print(report.to_json() if fmt == "json" else _status_text(report))
        return 0 if report.all_up else 1
    if action == "stop":
        report = stop(where)
        _print(report.to_json() if fmt == "json" else _stop_text(report))
        return 1 if any(d.state == "still running" for d in report.daemons) else 0
    raise ValueError(f"unknown poc action {action!r}")


def _print(what: object) -> None:
    print(what if isinstance(what, str) else json.dumps(what, indent=2))


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _q(path: Path) -> str:
    return shlex.quote(str(path))


def _prepare_text(folder: Path, report: PrepareReport) -> str:
    lines = report.provisioned.table()
    first, last = report.ports
    lines.append(
        f"POC prepared in {folder}: project file {report.project_file} ({report.project_status}); "
        f"the server will take ports {first}..{last} on 127.0.0.1"
    )
    lines.append(f"start it: flengine poc start -d {_q(folder)}")
    return "\n".join(lines)


def _rows(report: PocReport) -> list[str]:
    width = max([4, *(len(d.name) for d in report.daemons)])
    rows = [f"{'name':<{width}}  {'state':<13} {'pid':<8} detail"]
    for daemon in report.daemons:
        pid = str(daemon.pid) if daemon.pid is not None and daemon.state != "stopped" else "-"
        rows.append(f"{daemon.name:<{width}}  {daemon.state:<13} {pid:<8} {_detail(report, daemon)}".rstrip())
    return rows


def _detail(report: PocReport, daemon: Daemon) -> str:
    if daemon.kind == "server":
        return report.server
    if not daemon.site:
        return ""
    if not daemon.site.get("connected"):
        return "not connected"
    jobs = ", ".join(daemon.site.get("jobs") or []) or "no jobs"
    return f"connected, last status {daemon.site.get('last_status_s') or 0:.1f} s ago; {jobs}"


def _start_text(report: PocReport) -> str:
    sites = sum(1 for d in report.daemons if d.kind == "site")
    head = (
        f"started {', '.join(report.started)} in {report.folder}"
        if report.started
        else f"the POC in {report.folder} runs already; nothing started"
    )
    lines = [head, *_rows(report)]
    admin = _q(report.admin_kit) if report.admin_kit else "KIT"
    lines += [
        f"the server and {_count(sites, 'site')} run; logs in {report.folder}/workspaces/NAME/daemon.txt",
        f"submit a job:  flengine admin {admin} submit jobs/fedavg",
        f"watch it:      flengine admin {admin} watch JOB_ID  (the id that submit prints)",
        f"stop the POC:  flengine poc stop -d {_q(report.folder)}",
    ]
    return "\n".join(lines)


def _status_text(report: PocReport) -> str:
    lines = _rows(report)
    if report.server_error:
        lines.append(f"the server did not answer `clients`: {report.server_error}")
    if report.all_up:
        lines.append(f"the POC in {report.folder} is up; admin kit {report.admin_kit}")
    elif all(d.state != "running" for d in report.daemons):
        lines.append(f"the POC in {report.folder} is not running; start it: flengine poc start -d {_q(report.folder)}")
    else:
        lines.append(
            f"the POC in {report.folder} is partly up; `flengine poc start -d {_q(report.folder)}` starts the rest"
        )
    return "\n".join(lines)


def _stop_text(report: PocReport) -> str:
    if not report.daemons:
        return f"nothing runs in {report.folder}"
    lines = []
    width = max(len(d.name) for d in report.daemons)
    for daemon in report.daemons:
        if daemon.state == "stale":
            pid = f"pid {daemon.pid} is no longer this daemon" if daemon.pid is not None else "unreadable"
            what = f"stale pid file removed ({pid}; nothing signalled)"
        elif daemon.state == "still running":
            what = f"pid {daemon.pid} still runs after SIGKILL; its pid file is kept"
        else:
            what = f"{daemon.state} (pid {daemon.pid})"
        lines.append(f"{daemon.name:<{width}}  {what}")
    ended = any(d.state in ("stopped", "killed") for d in report.daemons)
    lines.append(f"the POC in {report.folder} is stopped" if ended else f"nothing ran in {report.folder}")
    return "\n".join(lines)
