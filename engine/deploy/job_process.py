"""`JobProcess`: one job process (``python -m engine.runtime.entry``) that a daemon starts and watches.

The server daemon starts a job's server process, each client daemon the job's client process on
its site: the same runtime and command line the simulator uses, with the kit's keys. A job
process ends by itself when its job ends, exits when its daemon goes away (``--parent-pid``), and
is stopped with SIGTERM (then SIGKILL after a grace) when the job is aborted. A server job process
started with ``exit_notices`` hears on its stdin when a site's job process ended (`tell_exit`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

#: Seconds a job process gets after SIGTERM before it is killed.
STOP_GRACE_S = 10.0


class JobProcess:
    """A running job process; ``on_exit(code)`` is called once, from a watcher thread, when it ends.

    Args:
        args: The arguments after ``python -m engine.runtime.entry``.
        folder: Where its stdout (``stdout.txt``) and stderr (``stderr.txt``) go.
        on_exit: Called with the exit code when the process ends (however it ends).
    """

    def __init__(
        self, args: Sequence[str], folder: Path, on_exit: Callable[[int], None], exit_notices: bool = False
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        command = [sys.executable, "-m", "engine.runtime.entry", *args, "--parent-pid", str(os.getpid())]
        if exit_notices:
            command.append("--exit-notices")
        self._notices_lock = threading.Lock()
        with open(folder / "stdout.txt", "ab") as out, open(folder / "stderr.txt", "ab") as err:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE if exit_notices else subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        if self._process.stdin is not None:
            os.set_blocking(self._process.stdin.fileno(), False)  # a process that does not read never stalls us
        self._on_exit = on_exit
        self._watcher = threading.Thread(target=self._watch, name=f"job-process-{self.pid}", daemon=True)
        self._watcher.start()
        log.info("job process started: pid=%d args=%s", self.pid, " ".join(args))

    @property
    def pid(self) -> int:
        """The process id."""
        return self._process.pid

    @property
    def running(self) -> bool:
        """Whether the process is still running."""
        return self._process.poll() is None

    def tell_exit(self, site: str, code: int) -> None:
        """Tell a process started with ``exit_notices`` that ``site``'s job process ended (a JSON line on stdin)."""
        self._notice({"exited": site, "code": code}, site)

    def tell_revoked(self, site: str) -> None:
        """Tell a process started with ``exit_notices`` that ``site`` was revoked: its job refuses it from now on."""
        self._notice({"revoked": site}, site)

    def _notice(self, notice: dict[str, object], site: str) -> None:
        stream = self._process.stdin
        if stream is None:
            return
        line = json.dumps(notice).encode("utf-8") + b"\n"
        with self._notices_lock:
            try:
                os.write(stream.fileno(), line)
            except BlockingIOError:
                log.warning("exit notice of %s not written: the job process does not read its stdin", site)
            except (OSError, ValueError):  # it has ended, or its stdin is closed
                pass

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL (its whole process group) if it has not ended after ``grace_s``."""
        if not self.running:
            return
        try:
            self._process.send_signal(signal.SIGTERM)  # a no-op once reaped: never a reused pid
            self._process.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("job process did not stop within %g s, killed: pid=%d", grace_s, self.pid)
            _kill_group(self.pid)
            self._process.wait(5.0)
        except ProcessLookupError:
            pass

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait for the end; the exit code, or None if still running after ``timeout_s``."""
        try:
            return self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def _watch(self) -> None:
        try:  # wait for the end without reaping, so the group is killed while its id is still ours
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        _kill_group(self.pid)  # a training script it started must not outlive it
        code = self._process.wait()
        log.info("job process ended: pid=%d code=%d", self.pid, code)
        try:
            self._on_exit(code)
        except Exception:
            log.exception("job process exit handler failed: pid=%d", self.pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
