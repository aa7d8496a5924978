"""`Launcher`: a run's job processes, forked from one process that imported torch once.

Starting a job process (``python -m engine.runtime.entry``) costs an import of torch and of the
engine, about 1.5 CPU-seconds; N + 1 of them at once on a machine of a few cores take about
(N + 1) / cores times that. The simulator therefore starts one launcher process
(``python -m engine.runtime.launcher_process``) that imports what a job process needs, once, and then
forks the server and every client as soon as it is ready: each job process starts with its
imports done (their memory shared copy-on-write) and runs ``engine.runtime.entry.main``. The
clients start together with the server, build their executors, and read the server's endpoint
on their stdin (``--connect -``) when the server listens.

The launcher talks JSON lines. Commands on its stdin::

    {"start": "site-1", "argv": [...], "cwd": DIR, "stderr": FILE, "stdout_fd": FD | null, "endpoint_pipe": true,
     "exit_notices": false}                    # exit_notices: its stdin gets {"exited": SITE, "code": N} lines
    {"endpoint": "tcp://127.0.0.1:5555"}       # written to every client started with endpoint_pipe (null: none)
    {"signal": "site-1", "signum": 15}

Reports on its stdout: ``{"event": "ready", "at": ...}``, ``{"event": "started", "site", "pid"}``
and ``{"event": "exited", "site", "code"}`` (a negative code: killed by that signal). When its
stdin closes (the simulator is done, or gone) it terminates the children still running, kills
them after `KILL_AFTER_S`, and exits; each child exits when the launcher goes away
(``--parent-pid``). Each child shows its own command line in ``ps`` (``python -m
engine.runtime.entry client ... --site site-1``), written into the room the launcher's own
command line reserved (`command_line_room`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from engine.runtime.launcher_process import KILL_AFTER_S, command_bytes

log = logging.getLogger(__name__)

#: Where the launcher's own errors (an import that fails) are kept, in the run's workspace.
LAUNCHER_ERRORS_FILE = "launcher-stderr.txt"
#: The most bytes of the launcher's errors kept.
MAX_ERRORS_BYTES = 64 << 10
#: Seconds `Launcher.stop_all` waits for a process after SIGTERM, then after SIGKILL.
STOP_WAIT_S = 5.0


def command_line_room(words: Sequence[str], clients: int) -> int:
    """Bytes of command line to reserve for a job process whose arguments name ``words`` (paths) and ``clients``.

    Each path may appear about three times (``--job``, ``--workspace``, ``--keys``, ``--allow-dir``),
    and the server's ``--clients`` names every client. A command line that does not fit is cut
    short at its end (`set_command_line`): the role and ``--site`` come first.
    """
    return 512 + 3 * len(command_bytes(words)) + 12 * clients


class LaunchedProcess:
    """A job process the launcher forked; the part of `subprocess.Popen`'s API the simulator uses.

    Attributes:
        site: The process's site.
        pid: Its process id, once the launcher reported it.
        returncode: Its exit code once it exited (negative: the signal that ended it), else None.
        stdout: The read end of its stdout, for the one process started with ``capture``.
    """

    def __init__(self, site: str, launcher: Launcher) -> None:
        self.site = site
        self.pid: int | None = None
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = None
        self._launcher = launcher

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait until it exits; raise `subprocess.TimeoutExpired` after ``timeout`` seconds."""
        if not self._launcher.wait_until(lambda: self.returncode is not None, timeout):
            raise subprocess.TimeoutExpired(self.site, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        """Send SIGTERM (nothing when it already exited)."""
        self._launcher.send_signal(self.site, signal.SIGTERM)

    def kill(self) -> None:
        """Send SIGKILL (nothing when it already exited)."""
        self._launcher.send_signal(self.site, signal.SIGKILL)


class Launcher:
    """The simulator's side of the launcher process.

    It starts the launcher at once, before the job is even validated: its imports run while the
    simulator checks the job. Its errors wait in a temporary file (`error_lines`) until `close`
    keeps them in the workspace, if there were any.

    Args:
        job: The job folder, shown in the launcher's command line (``ps``).
        room: Bytes of command line to reserve for the children's (`command_line_room`).
    """

    def __init__(self, job: str, room: int = 0) -> None:
        self.ready_at: float | None = None
        self._processes: dict[str, LaunchedProcess] = {}
        self._changed = threading.Condition()
        self._events_read, self._events_write = os.pipe()
        self._gone = False
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 (kept until close)
        try:  # the blank room is where each child writes its own command line
            self._process = subprocess.Popen(
                [sys.executable, "-m", "engine.runtime.launcher_process", "--job", job, "--room", " " * max(room, 1)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._errors,
                pass_fds=(self._events_write,),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            os.close(self._events_write)
        threading.Thread(target=self._read_reports, name="launcher-reports", daemon=True).start()

    def start(
        self,
        site: str,
        argv: list[str],
        cwd: Path,
        capture: bool = False,
        endpoint_pipe: bool = False,
        exit_notices: bool = False,
    ) -> LaunchedProcess:
        """Have ``python -m engine.runtime.entry *argv`` forked as ``site`` (as soon as the launcher is ready).

        Args:
            site: The process's site; its stderr (and stdout, unless captured) go to ``cwd/stderr.txt``.
            argv: The arguments of ``engine.runtime.entry``.
            cwd: Its working folder.
            capture: Its stdout is a pipe, `LaunchedProcess.stdout` (one process of a run at most).
            endpoint_pipe: Its stdin is a pipe that `send_endpoint` writes the server's endpoint to.
            exit_notices: Its stdin is a pipe that the launcher writes every other process's exit
                to, one JSON line each (``{"exited": SITE, "code": CODE}``): the server learns of a
                client's death at once instead of after the heartbeat timeout.
        """
        process = LaunchedProcess(site, self)
        command: dict[str, Any] = {
            "start": site,
            "argv": argv,
            "cwd": str(cwd),
            "stderr": str(cwd / "stderr.txt"),
            "stdout_fd": None,
            "endpoint_pipe": endpoint_pipe,
            "exit_notices": exit_notices,
        }
        if capture:
            command["stdout_fd"] = self._events_write
            process.stdout = os.fdopen(self._events_read, "rb")
        with self._changed:
            self._processes[site] = process
        self._send(command)
        return process

    def send_endpoint(self, endpoint: str | None) -> None:
        """Give every client started with ``endpoint_pipe`` the server's endpoint (None: close their stdin)."""
        self._send({"endpoint": endpoint})

    def tell_exit(self, site: str, code: int | None) -> None:
        """Tell the processes that take exit notices that ``site`` (not one of the launcher's) exited."""
        self._send({"exited": site, "code": code})

    def send_signal(self, site: str, signum: int) -> None:
        """Send ``signum`` to ``site``'s process, if it still runs (the launcher knows, having reaped it or not)."""
        process = self._processes.get(site)
        if process is not None and process.returncode is None:
            self._send({"signal": site, "signum": int(signum)})

    def wait_until(self, condition: Callable[[], bool], timeout: float | None) -> bool:
        """Wait for ``condition()`` (checked whenever the launcher reports); False after ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(condition, timeout)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the launcher has done its imports; False when it exited first or after ``timeout``."""
        self.wait_until(lambda: self.ready_at is not None or self._gone, timeout)
        return self.ready_at is not None

    def stop_all(self, at_once: Sequence[str], grace_s: float, workspace: Path | None = None) -> None:
        """Let the processes end by themselves, then terminate, then kill them; then `close`: none is left.

        Clients still waiting for an endpoint see their stdin close and exit.

        Args:
            at_once: The sites told to stop at once (SIGTERM); the others get ``grace_s`` seconds first.
            grace_s: Seconds the processes get to exit by themselves.
            workspace: Passed on to `close`.
        """
        self.send_endpoint(None)
        processes = list(self._processes.values())
        for process in processes:
            if process.site in at_once:
                process.terminate()
        deadline = time.monotonic() + grace_s
        for process in processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in processes:
            try:
                process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(STOP_WAIT_S)
            if process.stdout is not None:
                process.stdout.close()
        self.close(workspace)

    def error_lines(self) -> list[str]:
        """The non-empty lines the launcher wrote to its stderr (the end of them, at most `MAX_ERRORS_BYTES`)."""
        try:
            self._errors.seek(max(self._errors.seek(0, os.SEEK_END) - MAX_ERRORS_BYTES, 0))
            text = self._errors.read().decode("utf-8", errors="replace")
        except (OSError, ValueError):
            return []
        return [line.rstrip() for line in text.splitlines() if line.strip()]

    def close(self, workspace: Path | None = None, timeout_s: float = KILL_AFTER_S + 5.0) -> None:
        """Close the launcher's stdin (it ends the children left, then itself) and wait for it.

        Args:
            workspace: Where to keep what the launcher wrote on its stderr, if anything
                (`LAUNCHER_ERRORS_FILE`); None to drop it.
            timeout_s: Seconds to wait for it before it is killed.
        """
        if not self._processes:  # nothing started (a job refused): no need to wait for its imports
            self._process.kill()
        with contextlib.suppress(OSError):
            assert self._process.stdin is not None
            self._process.stdin.close()
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        lines = self.error_lines()
        if lines and workspace is not None and workspace.is_dir():
            with contextlib.suppress(OSError):
                (workspace / LAUNCHER_ERRORS_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
        self._errors.close()

    def _send(self, command: dict[str, Any]) -> None:
        try:
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps(command).encode("utf-8") + b"\n")
            self._process.stdin.flush()
        except (OSError, ValueError) as e:  # the launcher is gone; its report of that ends the run
            log.debug("launcher command not sent: %s", e)

    def _read_reports(self) -> None:
        assert self._process.stdout is not None
        for raw in self._process.stdout:
            try:
                report = json.loads(raw)
            except ValueError:
                continue
            with self._changed:
                process = self._processes.get(str(report.get("site")))
                if report.get("event") == "ready":
                    self.ready_at = float(report.get("at", time.time()))
                elif report.get("event") == "started" and process is not None:
                    process.pid = int(report["pid"])
                elif report.get("event") == "exited" and process is not None:
                    process.returncode = int(report["code"])
                self._changed.notify_all()
        with self._changed:  # the launcher is gone: its children (if any were left) go with it
            self._gone = True
            for process in self._processes.values():
                if process.returncode is None:
                    process.returncode = -int(signal.SIGKILL)
            self._changed.notify_all()
