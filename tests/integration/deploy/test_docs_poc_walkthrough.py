"""The POC walk-through of docs/deploy.md, run as a newcomer runs it: every command, in order, and
what the doc says each prints.

The commands and their sample output are read from the doc, not copied here, so the walk-through
cannot drift from what works. They run with the installed ``flengine`` in a fresh folder where
``jobs/`` is the repository's, as from the repository root. Only two things are adapted: the
job id, which the doc shows as ``JOB_ID``, is the one ``submit`` printed, and ``poc prepare``
takes a free block of ports instead of the doc's 8002, which another run may hold.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.deploy.poc.prepare import free_port_block
from tests.integration.runtime.conftest import processes_mentioning

REPO = Path(__file__).resolve().parents[3]
#: The placeholder the doc writes for the id ``submit`` prints.
JOB_PLACEHOLDER = "JOB_ID"
#: Seconds one walk-through command may take (`watch` lasts as long as the job).
COMMAND_TIMEOUT_S = 300
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

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
#: What differs from run to run in a sample line: a job id, or a number.
_VARIABLE = re.compile(r"(?<![0-9a-z])[0-9a-f]{12}(?![0-9a-z])|\d+")


@dataclass
class Step:
    """One ``$ flengine ...`` line of the walk-through and the sample output the doc shows under it."""

    command: str
    sample: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``poc prepare``, ``admin submit``, ``report``: the command without its arguments."""
        words = shlex.split(self.command)[1:]
        if words[0] == "admin":  # flengine admin KIT COMMAND ...
            return f"admin {words[2]}"
        return " ".join(words[:2]) if words[0] == "poc" else words[0]


def poc_section(text: str) -> str:
    """The section of deploy.md whose title names POC mode, up to the next section."""
    found = re.search(r"^## [^\n]*\bPOC\b[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, "docs/deploy.md has no section titled with POC"
    return found.group(1)


def walkthrough(text: str) -> list[Step]:
    """The ``$ `` commands of the POC section's code blocks, in order, each with the lines under it."""
    steps: list[Step] = []
    for block in _FENCE.findall(poc_section(text)):
        for line in block.splitlines():
            if line.startswith("$ "):
                command = re.split(r"\s#", line[2:], maxsplit=1)[0].strip()
                assert command.startswith("flengine "), f"docs/deploy.md: the walk-through runs {command!r}"
                steps.append(Step(command))
            elif line.strip():
                assert steps, f"docs/deploy.md: output before any command: {line!r}"
                steps[-1].sample.append(line)
    return steps


def line_pattern(line: str) -> re.Pattern[str]:
    """A sample output line as a pattern: ``...`` stands for anything, any job id for any job id,
    any number for any number, and a run of spaces for any run of spaces (columns are padded)."""
    pieces = []
    for chunk in line.strip().split("..."):
        words = []
        for word in chunk.split():
            parts, end = [], 0
            for variable in _VARIABLE.finditer(word):
                parts.append(re.escape(word[end : variable.start()]))
                parts.append(r"\d+" if variable.group().isdigit() else "[0-9a-f]{12}")
                end = variable.end()
            words.append("".join(parts) + re.escape(word[end:]))
        pieces.append(r"\s+".join(words))
    return re.compile(r"\s*" + ".*".join(pieces) + r"\s*")


def adapted(command: str, job_id: str | None, port: int) -> list[str]:
    """The doc's command as it runs here: the real job id for the placeholder, our port for prepare."""
    words = shlex.split(command)
    if JOB_PLACEHOLDER in command:
        assert job_id is not None, f"`{command}` uses {JOB_PLACEHOLDER} before a submit printed one"
        words = [word.replace(JOB_PLACEHOLDER, job_id) for word in words]
    if words[1:3] == ["poc", "prepare"]:
        if "--port" in words:
            words[words.index("--port") + 1] = str(port)
        else:
            words += ["--port", str(port)]
    return words


def flengine_executable() -> list[str]:
    """The installed ``flengine`` of this interpreter's environment (``python -m engine`` is the same)."""
    installed = shutil.which("flengine", path=str(Path(sys.executable).parent))
    return [installed] if installed else [sys.executable, "-m", "engine"]


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
    steps = walkthrough((REPO / "docs" / "deploy.md").read_text(encoding="utf-8"))
    names = [step.name for step in steps]
    assert [name for name in names if name in ESSENTIAL_STEPS] == ESSENTIAL_STEPS, names
    port = free_port_block(11)
    job_id: str | None = None
    printed: dict[str, str] = {}

    for step in steps:
        done = subprocess.run(
            [*flengine_executable(), *adapted(step.command, job_id, port)[1:]],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        assert done.returncode == 0, f"$ {step.command}\n{done.stdout}\n{done.stderr}"
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines()]
        for sample in step.sample:
            if sample.strip() != "...":
                assert any(line_pattern(sample).fullmatch(line) for line in lines), (
                    f"docs/deploy.md shows under `{step.command}` the line\n  {sample}\nwhich it no longer prints:\n"
                    + "\n".join(lines)
                )
        printed[step.name] = done.stdout
        if step.name == "admin submit":
            submitted = re.search(r"^submitted: ([0-9a-f]+) ", done.stdout, re.M)
            assert submitted, done.stdout
            job_id = submitted.group(1)

    downloaded = re.search(r"^downloaded to (\S+)$", printed["admin download"], re.M)
    assert downloaded, printed["admin download"]
    results = folder / downloaded.group(1)
    assert results.name == job_id
    summary = json.loads((results / "summary.json").read_text(encoding="utf-8"))
    assert (summary["job_id"], summary["status"]) == (job_id, "FINISHED_COMPLETED")
    assert (results / "server" / "models" / "global.safetensors").is_file()
    assert sorted(path.name for path in results.iterdir() if path.is_dir()) == ["server", "site-1", "site-2"]
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
