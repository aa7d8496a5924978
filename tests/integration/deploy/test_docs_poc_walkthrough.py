"""The POC walk-through of docs/deploy.md, run as a newcomer runs it: every command, in order, and
what the doc says each prints.

The commands and their sample output are read from the doc, not copied here, so the walk-through
cannot drift from what works. They run with the installed ``flengine`` in a fresh folder where
``jobs/`` is the repository's, as from the repository root. Only two things are adapted: the
job id, which the doc shows as ``JOB_ID``, is the one ``submit`` printed, and ``poc prepare``
takes a free block of ports instead of the doc's 8002, which another run may hold.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.deploy.poc.prepare import free_port_block
from tests.integration.deploy.doc_steps import (
    DEPLOY_MD,
    REPO,
    Step,
    assert_downloaded,
    assert_essential_steps,
    assert_sample_shown,
    flengine_executable,
    line_pattern,
    printed_lines,
    run_command,
    section,
    submitted_job_id,
    with_job_id,
)
from tests.integration.deploy.doc_steps import walkthrough as steps_of
from tests.integration.runtime.conftest import processes_mentioning

#: The steps the walk-through must keep, in this order (other commands may come between them).
ESSENTIAL_STEPS = [
    "poc prepare",
    "poc start",
    "admin submit",
    "admin watch",
    "admin status",
    "admin download",
    "report",
    "poc stop",
]


def poc_section(text: str) -> str:
    """The section of deploy.md whose title names POC mode, up to the next section."""
    return section(text, r"\bPOC\b")


def walkthrough(text: str) -> list[Step]:
    """The ``$ `` commands of the POC section's code blocks, in order, each with the lines under it."""
    steps = steps_of(poc_section(text))
    for step in steps:
        assert step.command.startswith("flengine "), f"docs/deploy.md: the walk-through runs {step.command!r}"
    return steps


def adapted(command: str, job_id: str | None, port: int) -> list[str]:
    """The doc's command as it runs here: the real job id for the placeholder, our port for prepare."""
    words = with_job_id(shlex.split(command), job_id, command)
    if words[1:3] == ["poc", "prepare"]:
        if "--port" in words:
            words[words.index("--port") + 1] = str(port)
        else:
            words += ["--port", str(port)]
    return words


@pytest.fixture
def folder(tmp_path: Path, no_leftovers: None) -> Iterator[Path]:
    """A fresh folder with the repository's ``jobs/``; a POC the test leaves running is stopped (and
    ``no_leftovers`` fails the test for any process left)."""
    (tmp_path / "jobs").symlink_to(REPO / "jobs", target_is_directory=True)
    try:
        yield tmp_path
    finally:
        if any((tmp_path / "poc" / "run").glob("*.pid")):
            subprocess.run([*flengine_executable(), "poc", "stop"], cwd=tmp_path, capture_output=True, timeout=60)


@pytest.mark.slow
def test_the_poc_walkthrough_runs_as_the_doc_shows(folder: Path) -> None:
    steps = walkthrough(DEPLOY_MD.read_text(encoding="utf-8"))
    assert_essential_steps(steps, ESSENTIAL_STEPS)
    port = free_port_block(11)
    job_id: str | None = None
    printed: dict[str, str] = {}

    for step in steps:
        done = run_command([*flengine_executable(), *adapted(step.command, job_id, port)[1:]], folder)
        assert done.returncode == 0, f"$ {step.command}\n{done.stdout}\n{done.stderr}"
        assert_sample_shown(step, printed_lines(done.stdout, done.stderr))
        printed[step.name] = done.stdout
        if step.name == "admin submit":
            job_id = submitted_job_id(done.stdout)

    results = assert_downloaded(folder, printed["admin download"], job_id)
    report = re.search(r"^report: (\S+\.html) ", printed["report"], re.M)
    assert report, printed["report"]
    assert Path(report.group(1)) == (results / "report.html").resolve()
    assert "FINISHED_COMPLETED" in (results / "report.html").read_text(encoding="utf-8")
    assert list((folder / "poc" / "run").iterdir()) == []
    assert processes_mentioning(str(folder.resolve())) == [], "processes outlived `flengine poc stop`"


@pytest.mark.parametrize(
    ("sample", "printed", "matches"),
    [
        ("submitted: cea51a3d3623 (fedavg)", "submitted: 0123456789ab (fedavg)", True),
        ("site-1  running       32357    connected", "site-1  running  4  connected", True),
        (
            "report: .../results/cea51a3d3623/report.html (6 of 7 plots)",
            "report: /tmp/x/results/0123456789ab/report.html (5 of 7 plots)",
            True,
        ),
        ("site-1  running  pid 3237  connected", "site-1  running  3237  connected", False),
        ("submitted: cea51a3d3623 (fedavg)", "submitted: cea51a3d3623 (fedprox)", False),
    ],
    ids=["job-id", "padding-and-pid", "ellipsis", "a-changed-column", "a-changed-word"],
)
def test_a_sample_line_matches_what_differs_between_runs_only(sample: str, printed: str, matches: bool) -> None:
    assert bool(line_pattern(sample).fullmatch(printed)) is matches


def test_the_walkthrough_is_read_with_its_sample_output() -> None:
    text = "## Trying it: POC mode\n\n```\n$ flengine poc start   # note\nstarted\n...\n$ flengine poc stop\n```\n## Next\n```\n$ flengine run x\n```\n"

    steps = walkthrough(text)

    assert [(step.command, step.sample) for step in steps] == [
        ("flengine poc start", ["started", "..."]),
        ("flengine poc stop", []),
    ]
