"""How a training script's process is launched: the ``command`` in front of it, and its stderr.

``command`` is an argv (a list, or a string split like a shell would, but never given to a
shell): ``"python -u"``, ``"torchrun --standalone --nproc_per_node 2"``. The script's path and
``task_script_args`` follow it. ``python`` (``python3``) is this environment's interpreter and
``torchrun`` is ``<it> -m torch.distributed.run``, so the client's own PyTorch runs the script;
any other program must be an absolute path or found on ``PATH``.

`StderrTail` forwards the script's stderr to the client's and keeps what explains a crash: the
first and last exception lines of its tracebacks and its last lines.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import shlex
import shutil
import sys
import threading
from pathlib import Path
from typing import IO

from engine.text import printable

#: Characters a shell would act on: refused in ``command`` (it is never run by a shell, so they
#: could only be a mistake: a pipe, a redirection or a variable that would be passed literally).
SHELL_METACHARACTERS = frozenset(";&|$`<>(){}[]*?!~#'\"\\\n\r")
#: Programs that name this environment's interpreter.
PYTHON_NAMES = frozenset({"python", "python3", f"python{sys.version_info.major}.{sys.version_info.minor}"})
#: The launcher of PyTorch, run as a module of this environment's interpreter.
TORCHRUN = "torchrun"
#: Variables of a launch the client itself may have been started in; the script must not inherit them.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
#: Lines of stderr kept, the longest line shown, and the most lines shown in a reason.
TAIL_LINES = 40
LINE_CHARS = 300
SHOWN_LINES = 3
#: Bytes of one stderr line read at a time (a longer line is handled in pieces).
_READ_BYTES = 65536

_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)\b")


def parse_command(command: str | list[str], key: str = "command") -> list[str]:
    """The argv of ``command`` (empty when it is empty), with every shell metacharacter refused.

    Args:
        command: A string (split with `shlex.split`) or a list of strings.
        key: The config key, for messages.

    Raises:
        ValueError: Not a string or a list of strings, a string that does not split (an open
            quote), an empty program, or a shell metacharacter anywhere.
    """
    if isinstance(command, str):
        try:
            argv = shlex.split(command)
        except ValueError as e:
            raise ValueError(f"{key}: cannot split {command!r}: {e}") from e
    elif isinstance(command, list) and all(isinstance(item, str) for item in command):
        argv = list(command)
    else:
        raise ValueError(f"{key}: expected a string or a list of strings, got {command!r}")
    for item in argv:
        bad = sorted({ch for ch in item if ch in SHELL_METACHARACTERS or not ch.isprintable()})
        if bad:
            shown = "".join(printable(ch) for ch in bad)
            raise ValueError(
                f"{key}: '{printable(item)}' has shell syntax ({shown}), but the command runs without a shell: "
                "give the program and its arguments only (no pipes, redirections, variables, globs or quotes "
                'inside words), e.g. "torchrun --standalone --nproc_per_node 2"'
            )
        if not item:
            raise ValueError(f"{key}: an empty argument in {command!r}")
    return argv


def resolve_command(argv: list[str], key: str = "command") -> list[str]:
    """The argv to run: ``python`` and ``torchrun`` made this environment's, other programs looked up.

    An empty ``argv`` is ``[sys.executable]``.

    Raises:
        FileNotFoundError: The program is not found (or not executable), or ``torchrun`` is asked
            for where PyTorch is not installed; the message names ``key`` and the fix.
    """
    if not argv:
        return [sys.executable]
    program, rest = argv[0], argv[1:]
    if program in PYTHON_NAMES:
        return [sys.executable, *rest]
    if program == TORCHRUN:
        if importlib.util.find_spec("torch") is None:
            raise FileNotFoundError(
                f"{key}: torchrun needs PyTorch in the client's environment ({sys.executable}); pip install torch"
            )
        return [sys.executable, "-m", "torch.distributed.run", *rest]
    if os.sep in program or (os.altsep and os.altsep in program):
        path = Path(program)
        if not path.is_absolute():
            raise FileNotFoundError(
                f"{key}: {program!r} is a relative path; give the program's absolute path or its name on PATH"
            )
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"{key}: {program!r} is not an executable file")
        return [str(path), *rest]
    found = shutil.which(program)
    if found is None:
        raise FileNotFoundError(
            f"{key}: program {program!r} not found on PATH; install it in the client's environment, give its "
            "absolute path, or use python or torchrun (this environment's)"
        )
    return [found, *rest]


def script_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without the rank variables of a launch the client may itself run in."""
    return {name: value for name, value in environ.items() if name not in LAUNCH_VARIABLES}


class StderrTail:
    """Reads a process's stderr to its end, forwards it, and keeps the lines that explain a crash.

    Args:
        forward: Where each line goes on (the client's stderr, fd 2, by default); None drops them.
    """

    def __init__(self, forward: IO[bytes] | None | int = 2) -> None:
        self._forward = forward
        self._lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._first_error: str | None = None
        self._last_errors: collections.deque[str] = collections.deque(maxlen=2)
        self._in_traceback = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def follow(self, stream: IO[bytes], name: str = "stderr") -> None:
        """Read ``stream`` in a daemon thread until it ends."""
        self._thread = threading.Thread(target=self._pump, args=(stream,), name=name, daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the stream to end (the process exited: its last lines are read)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def add(self, raw: bytes) -> None:
        """Take one line (as read, newline included)."""
        text = printable(raw.decode("utf-8", errors="replace").rstrip("\r\n"), LINE_CHARS)
        if not text.strip():
            return
        bare = _RANK_PREFIX.sub("", text)
        text = text.strip()
        with self._lock:
            self._lines.append(text)
            if bare.startswith("Traceback (most recent call last)"):
                self._in_traceback = True
            elif self._in_traceback and not bare[:1].isspace():  # the line after the indented frames
                self._in_traceback = False
                self._error(text)
            elif not self._in_traceback and _EXCEPTION_LINE.match(bare):
                self._error(text)

    def summary(self) -> str:
        """The exception lines (the first one, usually the cause, and the last two) and the last lines."""
        with self._lock:
            errors = [self._first_error] if self._first_error else []
            errors += [line for line in self._last_errors if line not in errors]
            last = [line for line in list(self._lines)[-SHOWN_LINES:] if line not in errors]
        parts = []
        if errors:
            parts.append("errors: " + " | ".join(errors))
        if last:
            parts.append("stderr ends: " + " | ".join(last))
        return "; ".join(parts) if parts else "nothing on its stderr"

    def _error(self, line: str) -> None:
        if self._first_error is None:
            self._first_error = line
        else:
            self._last_errors.append(line)

    def _pump(self, stream: IO[bytes]) -> None:
        try:
            for raw in iter(lambda: stream.readline(_READ_BYTES), b""):
                self._pass_on(raw)
                self.add(raw)
        except (OSError, ValueError):  # the pipe closed under us: the process is gone
            pass
        finally:
            stream.close()

    def _pass_on(self, raw: bytes) -> None:
        if self._forward is None:
            return
        try:
            if isinstance(self._forward, int):
                view = memoryview(raw)
                while view:
                    view = view[os.write(self._forward, view) :]
            else:
                self._forward.write(raw)
                self._forward.flush()
        except (OSError, ValueError):
            self._forward = None  # the client's stderr is gone; keep the tail all the same
