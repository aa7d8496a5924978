"""The launcher process (``python -m engine.runtime.launcher_process``): imports once, forks job processes.

See `engine.runtime.launcher` for why and for the protocol: it reads JSON-line commands on its
stdin, forks ``engine.runtime.entry.main`` for each ``start`` (each child with its own stdio,
folder and command line), writes the endpoint to the clients that wait for it, tells the
processes started with ``exit_notices`` (the server) of every other process's exit on their
stdin (``{"exited": SITE, "code": CODE}`` lines), forwards signals, and reports ``ready``,
``started`` and ``exited`` on its stdout. When its stdin closes
it terminates the children still running, kills them after `KILL_AFTER_S`, and exits without
the interpreter's teardown.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import selectors
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

#: The module each launched process runs, as its command line says.
ENTRY_WORDS = ("-m", "engine.runtime.entry")
#: Seconds children get after SIGTERM, once the launcher's stdin closed, before SIGKILL.
KILL_AFTER_S = 10.0


def main(argv: Sequence[str] | None = None) -> int:
    """The launcher process: import once, then fork the job processes the simulator asks for."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the simulator's to handle
    import engine.runtime.entry as entry  # what every job process needs, imported once for all

    reports = sys.stdout
    _report(reports, event="ready", at=round(time.time(), 4))
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children: dict[int, str] = {}
    pids: dict[str, int] = {}
    endpoint_pipes: dict[str, int] = {}
    notice_pipes: dict[str, int] = {}  # site -> the write end of its stdin, for exit notices
    pending = b""
    kill_at: float | None = None
    while kill_at is None or children:
        timeout = None if kill_at is None else max(kill_at - time.monotonic(), 0.0)
        for key, _ in selector.select(timeout):
            if key.fd == wake_read:
                with contextlib.suppress(OSError):
                    os.read(wake_read, 4096)
                continue
            data = os.read(0, 1 << 16)
            if not data:  # the simulator is done, or gone
                selector.unregister(0)
                kill_at = time.monotonic() + KILL_AFTER_S
                _close_all(endpoint_pipes)
                _close_all(notice_pipes)
                _signal_all(children, signal.SIGTERM)
                continue
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                _command(json.loads(line), entry.main, children, pids, (endpoint_pipes, notice_pipes), reports)
        _reap(children, reports, notice_pipes)
        if kill_at is not None and time.monotonic() >= kill_at:
            _signal_all(children, signal.SIGKILL)
            kill_at = time.monotonic() + 1.0
    return 0


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown of torch (nothing of the launcher's is left to write)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _command(
    command: dict[str, Any],
    entry_main: Callable[[list[str]], int],
    children: dict[int, str],
    pids: dict[str, int],
    pipes: tuple[dict[str, int], dict[str, int]],
    reports: IO[str],
) -> None:
    endpoint_pipes, notice_pipes = pipes
    if "start" in command:
        site = str(command["start"])
        pid = _fork(command, entry_main, endpoint_pipes, notice_pipes)
        children[pid], pids[site] = site, pid
        _report(reports, event="started", site=site, pid=pid)
    elif "endpoint" in command:  # null: there will be none (the clients see their stdin close)
        line = b"" if command["endpoint"] is None else str(command["endpoint"]).encode("utf-8") + b"\n"
        for fd in endpoint_pipes.values() if line else []:
            with contextlib.suppress(OSError):  # a client that is gone
                os.write(fd, line)
        _close_all(endpoint_pipes)
    elif "exited" in command:  # a process the simulator runs elsewhere (a Ray actor) ended
        code = command.get("code")
        _tell_exit(notice_pipes, str(command["exited"]), code if isinstance(code, int) else None)
    elif "signal" in command:
        pid = pids.get(str(command["signal"]))
        if pid in children:  # not reaped yet: the pid is still this child's
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, int(command["signum"]))


def _fork(
    command: dict[str, Any],
    entry_main: Callable[[list[str]], int],
    endpoint_pipes: dict[str, int],
    notice_pipes: dict[str, int],
) -> int:
    stdin_read = None
    if command.get("endpoint_pipe") or command.get("exit_notices"):
        stdin_read, stdin_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(command, entry_main, stdin_read)  # never returns
    if stdin_read is not None:
        os.close(stdin_read)
        if command.get("exit_notices"):
            os.set_blocking(stdin_write, False)  # a server that does not read never stalls the launcher
            notice_pipes[str(command["start"])] = stdin_write
        else:
            endpoint_pipes[str(command["start"])] = stdin_write
    if command.get("stdout_fd") is not None:  # the child's copy is the only one left: its exit is EOF
        with contextlib.suppress(OSError):
            os.close(int(command["stdout_fd"]))
    return pid


def _child(command: dict[str, Any], entry_main: Callable[[list[str]], int], stdin_read: int | None) -> None:
    """In the forked process: its own stdio, folder and command line, then the job process itself."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(command["cwd"])
        errors = os.open(command["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        stdin = stdin_read if stdin_read is not None else os.open(os.devnull, os.O_RDONLY)
        stdout = int(command["stdout_fd"]) if command.get("stdout_fd") is not None else errors
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(errors, 2)
        os.closerange(3, _max_fd())  # the launcher's pipes and every other child's
        argv = [str(word) for word in command["argv"]]
        set_command_line([sys.executable, *ENTRY_WORDS, *argv])
        _reseed_numpy()
        code = entry_main(argv)
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _reap(children: dict[int, str], reports: IO[str], notice_pipes: dict[str, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        site = children.pop(pid, None)
        if site is not None:
            code = os.waitstatus_to_exitcode(status)
            _report(reports, event="exited", site=site, code=code)
            _tell_exit(notice_pipes, site, code)


def _tell_exit(notice_pipes: dict[str, int], site: str, code: int | None) -> None:
    """Write ``site``'s exit to the processes that take exit notices; forget a pipe whose reader is gone."""
    own = notice_pipes.pop(site, None)
    if own is not None:
        with contextlib.suppress(OSError):
            os.close(own)
    line = json.dumps({"exited": site, "code": code}).encode("utf-8") + b"\n"
    for listener, fd in list(notice_pipes.items()):
        try:
            os.write(fd, line)
        except BlockingIOError:
            pass  # its reader is behind: it learns of the exit from the missing heartbeats instead
        except OSError:
            notice_pipes.pop(listener, None)
            with contextlib.suppress(OSError):
                os.close(fd)


def _signal_all(children: dict[int, str], signum: int) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _report(stream: IO[str], **fields: Any) -> None:
    with contextlib.suppress(OSError, ValueError):  # the simulator is gone; stdin's EOF says so too
        stream.write(json.dumps(fields) + "\n")
        stream.flush()


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 1024


def _reseed_numpy() -> None:
    """Give numpy's global generator a seed of its own (``random`` reseeds itself after a fork)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(int.from_bytes(os.urandom(4), "little"))


def command_bytes(words: Sequence[str]) -> bytes:
    """A command line as ``/proc/PID/cmdline`` holds it: the words, each ended by a NUL but the last."""
    return b"\0".join(os.fsencode(word) for word in words)


def set_command_line(words: Sequence[str]) -> bool:
    """Show ``words`` as this process's command line (``ps``, ``/proc/PID/cmdline``), as far as it fits.

    A forked process keeps the command line of the process it was forked from; this writes the
    new one over it, in place, as ``setproctitle`` does: only into the bytes the kernel says the
    command line occupies, and only after checking that they hold what ``/proc/self/cmdline``
    shows. False (nothing written) where that cannot be checked (not Linux).
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
        current = Path("/proc/self/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False
    room = end - start
    if room <= 1 or room > 1 << 20 or ctypes.string_at(start, room) != current:
        return False
    data = command_bytes(words)[: room - 1]
    ctypes.memmove(start, data.ljust(room, b"\0"), room)
    return True


if __name__ == "__main__":
    _exit_now(main())
