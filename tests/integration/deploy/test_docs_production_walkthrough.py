"""The production walk-through of docs/deploy.md, run as an operator runs it: every command of its
sections on provisioning, starting and administering, in order, and what the doc says each prints.

The commands and their sample output are read from the doc, not copied here. They run with the
installed ``flengine`` in a fresh folder that stands for the doc's ``/srv/flengine``: it holds
``docs/project.conf`` and the repository's ``jobs/``, and every kit. Only what must differ on a
test machine is adapted:

* the project file is the repository's docs/project.conf with the server's host and port alone
  changed (127.0.0.1 and a free block of ports, for ``fl.example.org`` and 8002);
* ``/srv/flengine`` in the sample output is the folder;
* the job id, which the doc shows as ``JOB_ID``, is the one ``submit`` printed;
* the daemons the doc starts in the foreground (``kits/NAME/start.sh``, a terminal each) run in
  the background; the test goes on once each printed its ``started`` line, and at the end stops
  them as the doc does, the sites first, then the server, with SIGTERM (Ctrl-C in the doc): each
  must print its ``stopped`` line and exit 0, and leave no process behind.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from engine.deploy.poc.prepare import free_port_block
from engine.provision import load_project
from tests.integration.deploy.doc_steps import (
    DEPLOY_MD,
    REPO,
    Step,
    assert_downloaded,
    assert_essential_steps,
    assert_sample_shown,
    flengine_executable,
    printed_lines,
    run_command,
    submitted_job_id,
    walkthrough,
    with_job_id,
)
from tests.integration.runtime.conftest import processes_mentioning

#: The folder the doc runs the walk-through in; the test's own folder stands for it.
SERVED_FROM = "/srv/flengine"
#: The project file the doc provisions, relative to that folder (a copy of the repository's).
PROJECT_FILE = "docs/project.conf"
#: The server's address in the project file, and what it is on a test machine (the port: a free one).
EXAMPLE_HOST, TEST_HOST = "fl.example.org", "127.0.0.1"
EXAMPLE_PORT = 8002
#: Seconds a daemon may take to print its ``started`` line, and to exit once stopped.
DAEMON_TIMEOUT_S = 60
#: The steps the walk-through must keep, in this order (other commands may come between them).
ESSENTIAL_STEPS = [
    "validate",
    "provision",
    "kits/server/start.sh",
    "kits/site-1/start.sh",
    "kits/site-2/start.sh",
    "admin submit",
    "admin watch",
    "admin status",
    "admin download",
    "report",
]
_DAEMON_SCRIPT = re.compile(r"kits/[\w-]+/start\.sh")


def production_part(text: str) -> str:
    """The production sections of deploy.md: from its first ``## `` section up to the POC one."""
    found = re.search(r"^## .*?(?=^## [^\n]*\bPOC\b)", text, re.M | re.S)
    assert found, "docs/deploy.md has no sections before its POC section"
    return found.group(0)


def production_walkthrough(text: str) -> list[Step]:
    """The ``$ `` commands of the production sections, in order, each with the lines under it: a
    ``flengine`` command, or a kit's ``start.sh``."""
    steps = walkthrough(production_part(text))
    for step in steps:
        assert step.command.startswith("flengine ") or _DAEMON_SCRIPT.fullmatch(step.name), (
            f"docs/deploy.md: the production walk-through runs {step.command!r}"
        )
    return steps


def write_project_file(folder: Path, port: int) -> Path:
    """docs/project.conf under ``folder``: the repository's, with only the server's host and port
    changed to ``TEST_HOST`` and ``port``."""
    text = (REPO / PROJECT_FILE).read_text(encoding="utf-8")
    for key, example, here in (("host", EXAMPLE_HOST, TEST_HOST), ("port", EXAMPLE_PORT, port)):
        text, found = re.subn(rf"^(\s*{key}\s*=\s*){re.escape(str(example))}\b", rf"\g<1>{here}", text, flags=re.M)
        assert found == 1, f"{PROJECT_FILE} does not set the server's {key} to {example} once"
    written = folder / PROJECT_FILE
    written.parent.mkdir(parents=True, exist_ok=True)
    written.write_text(text, encoding="utf-8")
    return written


def environment(folder: Path) -> dict[str, str]:
    """This environment with the installed ``flengine`` first on ``PATH``, as the kits' ``start.sh``
    run it (or a ``flengine`` script in ``folder/bin`` that runs ``python -m engine``)."""
    command = flengine_executable()
    if len(command) == 1:
        bin_dir = Path(command[0]).parent
    else:
        bin_dir = folder / "bin"
        bin_dir.mkdir()
        shim = bin_dir / "flengine"
        shim.write_text(f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n', encoding="utf-8")
        shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


class Daemon:
    """A daemon the doc starts in the foreground (a kit's ``start.sh``), run here in the background;
    its output (stdout and stderr) is read as it comes."""

    def __init__(self, step: Step, argv: list[str], cwd: Path, env: Mapping[str, str]) -> None:
        self.step = step
        self.process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line.rstrip("\n"))
            self._lines.put(line)
        self._lines.put(None)

    def wait_started(self, timeout_s: float = DAEMON_TIMEOUT_S) -> list[str]:
        """The lines printed up to and with the ``started`` one (a failure if it ends first or takes too long)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"$ {self.step.command}: no `started` line in {timeout_s} s:\n" + self.text()
                ) from None
            assert line is not None, f"$ {self.step.command} ended (exit {self.process.wait()}):\n" + self.text()
            if " started; " in line:
                return printed_lines(*self.output)

    def terminate(self, timeout_s: float = DAEMON_TIMEOUT_S) -> int:
        """Stop it with SIGTERM, as Ctrl-C in its terminal does; its exit code, once its output is read."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout_s)
        self._reader.join(10)
        return code

    def stop(self) -> None:
        """Stop it if it still runs (SIGTERM, then SIGKILL), and wait for it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._reader.join(10)

    def text(self) -> str:
        return "\n".join(self.output)


@pytest.fixture
def folder(tmp_path: Path, no_leftovers: None) -> Path:
    """A fresh folder with the repository's ``jobs/``, standing for the doc's ``/srv/flengine``
    (``no_leftovers`` fails the test for any process left)."""
    (tmp_path / "jobs").symlink_to(REPO / "jobs", target_is_directory=True)
    return tmp_path


@pytest.fixture
def daemons(folder: Path) -> Iterator[list[Daemon]]:
    """The daemons the walk-through starts; any still running at the end is stopped."""
    started: list[Daemon] = []
    try:
        yield started
    finally:
        for daemon in reversed(started):
            daemon.stop()


@pytest.mark.slow
def test_the_production_walkthrough_runs_as_the_doc_shows(folder: Path, daemons: list[Daemon]) -> None:
    steps = production_walkthrough(DEPLOY_MD.read_text(encoding="utf-8"))
    assert_essential_steps(steps, ESSENTIAL_STEPS)
    write_project_file(folder, free_port_block(11))
    env = environment(folder)
    here = {SERVED_FROM: str(folder.resolve())}
    job_id: str | None = None
    printed: dict[str, str] = {}

    for step in steps:
        words = with_job_id(shlex.split(step.command), job_id, step.command)
        if words[0] != "flengine":  # a kit's start.sh: a daemon, in the foreground in the doc
            daemon = Daemon(step, words, folder, env)
            daemons.append(daemon)
            assert_sample_shown(step, daemon.wait_started(), here)
            continue
        done = run_command([*flengine_executable(), *words[1:]], folder, env)
        assert done.returncode == 0, f"$ {step.command}\n{done.stdout}\n{done.stderr}"
        assert_sample_shown(step, printed_lines(done.stdout, done.stderr), here)
        printed[step.name] = done.stdout
        if step.name == "admin submit":
            job_id = submitted_job_id(done.stdout)

    for daemon in reversed(daemons):  # the sites, then the server: each says it stopped and exits 0
        code = daemon.terminate()
        started = next(line for line in daemon.output if " started; " in line)
        assert (code, daemon.output[-1]) == (0, started.split(" started; ")[0] + " stopped"), daemon.text()

    kits = folder / "kits"
    assert sorted(path.name for path in kits.iterdir()) == sorted(
        [p.name for p in load_project(folder / PROJECT_FILE).participants]
        + ["server-workspace", "site-1-workspace", "site-2-workspace"]
    )
    for kit in ("server", "site-1", "site-2", "alice"):
        assert stat.S_IMODE((kits / kit).stat().st_mode) == 0o700
        assert stat.S_IMODE((kits / kit / "keys" / f"{kit}.key_secret").stat().st_mode) == 0o600
        assert {"kit.json", "keys", "start.sh", "MANIFEST.json"} <= {path.name for path in (kits / kit).iterdir()}
    for workspace in ("server-workspace", "site-1-workspace", "site-2-workspace"):
        assert (kits / workspace / "log.txt").is_file() and (kits / workspace / "audit.log").is_file()

    results = assert_downloaded(folder, printed["admin download"], job_id)
    assert "FINISHED_COMPLETED" in (results / "report.html").read_text(encoding="utf-8")
    assert processes_mentioning(str(folder.resolve())) == [], "processes outlived the daemons"


def test_the_production_walkthrough_is_read_with_its_sample_output() -> None:
    text = (
        "# Deploying\n```\n$ flengine run x\n```\n"
        "## Provisioning\n\n```hocon\nname = p\n```\n"
        "```\n$ flengine provision p.conf --output kits   # note\nstatus ...\n...\n"
        "$ kits/server/start.sh   # = flengine server start kits/server\nserver ... started\n```\n"
        "### Who may do what\n```\n$ flengine admin kits/alice list\n```\n"
        "## Trying it on one machine: POC mode\n```\n$ flengine poc start\n```\n"
    )

    steps = production_walkthrough(text)

    assert [(step.name, step.command, step.sample) for step in steps] == [
        ("provision", "flengine provision p.conf --output kits", ["status ...", "..."]),
        ("kits/server/start.sh", "kits/server/start.sh", ["server ... started"]),
        ("admin list", "flengine admin kits/alice list", []),
    ]


def test_the_docs_production_walkthrough_keeps_its_steps_and_shows_their_output() -> None:
    steps = production_walkthrough(DEPLOY_MD.read_text(encoding="utf-8"))

    assert_essential_steps(steps, ESSENTIAL_STEPS)
    assert all(step.sample for step in steps), [step.command for step in steps if not step.sample]


def test_the_project_file_the_doc_shows_is_docs_project_conf(tmp_path: Path) -> None:
    shown = re.search(
        r"^```hocon\n(name = .*?)^```", production_part(DEPLOY_MD.read_text(encoding="utf-8")), re.M | re.S
    )
    assert shown, "docs/deploy.md shows no project file"
    (tmp_path / "shown.conf").write_text(shown.group(1), encoding="utf-8")

    doc_project = load_project(tmp_path / "shown.conf")
    example = load_project(REPO / PROJECT_FILE)

    assert (doc_project.name, doc_project.server, doc_project.participants) == (
        example.name,
        example.server,
        example.participants,
    )


def test_the_test_project_file_changes_the_servers_host_and_port_only(tmp_path: Path) -> None:
    written = write_project_file(tmp_path, 40123)

    changed = [
        (old, new)
        for old, new in zip(
            (REPO / PROJECT_FILE).read_text(encoding="utf-8").splitlines(),
            written.read_text(encoding="utf-8").splitlines(),
            strict=True,
        )
        if old != new
    ]
    assert [(old.split("#")[0].strip(), new.split("#")[0].strip()) for old, new in changed] == [
        (f"host = {EXAMPLE_HOST}", f"host = {TEST_HOST}"),
        (f"port = {EXAMPLE_PORT}", "port = 40123"),
    ]
    assert load_project(written).server.connect_address == f"tcp://{TEST_HOST}:40123"
