"""The walk-throughs of docs/deploy.md as steps a test runs: reading them from the doc, running them,
and matching what they print against the doc's sample output.

A walk-through is the code blocks of one part of the doc that hold ``$ `` lines: each ``$ ``
line is a command, and the lines under it, up to the next command, are what the doc says it prints
(cut at ``...``). Blocks without a ``$ `` line (a project file, a kit's tree) show files, not
commands, and are not part of it. The POC test (test_docs_poc_walkthrough.py) and the production
test (test_docs_production_walkthrough.py) both run theirs from here.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
#: The doc both walk-throughs are read from.
DEPLOY_MD = REPO / "docs" / "deploy.md"
#: The placeholder the doc writes for the id ``submit`` prints.
JOB_PLACEHOLDER = "JOB_ID"
#: Seconds one walk-through command may take (`watch` lasts as long as the job).
COMMAND_TIMEOUT_S = 300

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
#: What differs from run to run in a sample line: a job id, or a number.
_VARIABLE = re.compile(r"(?<![0-9a-z])[0-9a-f]{12}(?![0-9a-z])|\d+")


@dataclass
class Step:
    """One ``$ `` line of a walk-through and the sample output the doc shows under it."""

    command: str
    sample: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``poc prepare``, ``admin submit``, ``report``: the command without its arguments; a script
        the doc runs (``kits/server/start.sh``) is named as written."""
        words = shlex.split(self.command)
        if words[0] != "flengine":
            return words[0]
        words = words[1:]
        if words[0] == "admin":  # flengine admin KIT COMMAND ...
            return f"admin {words[2]}"
        return " ".join(words[:2]) if words[0] == "poc" else words[0]


def section(text: str, title: str) -> str:
    """The ``## `` section of a markdown text whose title matches the regex ``title``, up to the
    next ``## `` section (its ``### `` subsections included)."""
    found = re.search(rf"^## [^\n]*{title}[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"docs/deploy.md has no section titled with {title!r}"
    return found.group(1)


def walkthrough(text: str) -> list[Step]:
    """The ``$ `` commands of the code blocks of ``text`` (one part of a doc), in order, each with the
    lines the doc shows under it. Blocks with no ``$ `` line are skipped; a ``  # comment`` after a
    command is dropped."""
    steps: list[Step] = []
    for block in _FENCE.findall(text):
        lines = block.splitlines()
        if not any(line.startswith("$ ") for line in lines):
            continue
        for line in lines:
            if line.startswith("$ "):
                steps.append(Step(re.split(r"\s#", line[2:], maxsplit=1)[0].strip()))
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


def with_job_id(words: list[str], job_id: str | None, command: str) -> list[str]:
    """``words`` with the real job id for the doc's placeholder (an error if none was printed yet)."""
    if not any(JOB_PLACEHOLDER in word for word in words):
        return words
    assert job_id is not None, f"`{command}` uses {JOB_PLACEHOLDER} before a submit printed one"
    return [word.replace(JOB_PLACEHOLDER, job_id) for word in words]


def flengine_executable() -> list[str]:
    """The installed ``flengine`` of this interpreter's environment (``python -m engine`` is the same)."""
    installed = shutil.which("flengine", path=str(Path(sys.executable).parent))
    return [installed] if installed else [sys.executable, "-m", "engine"]


def run_command(
    argv: list[str], cwd: Path, env: Mapping[str, str] | None = None, timeout_s: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run one walk-through command to its end in ``cwd``, its output captured as text."""
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


def printed_lines(*outputs: str) -> list[str]:
    """The lines a command printed (stdout and stderr), stripped, as `assert_sample_shown` takes them."""
    return [line.strip() for output in outputs for line in output.splitlines()]


def assert_sample_shown(step: Step, lines: Iterable[str], replacements: Mapping[str, str] | None = None) -> None:
    """Every sample line the doc shows under ``step`` (but a bare ``...``) is one of ``lines``, with
    each key of ``replacements`` (a path the doc shows) in the sample replaced by its value first."""
    lines = list(lines)
    for sample in step.sample:
        if sample.strip() == "...":
            continue
        expected = sample
        for shown, real in (replacements or {}).items():
            expected = expected.replace(shown, real)
        assert any(line_pattern(expected).fullmatch(line) for line in lines), (
            f"docs/deploy.md shows under `{step.command}` the line\n  {sample}\nwhich it no longer prints:\n"
            + "\n".join(lines)
        )


def submitted_job_id(stdout: str) -> str:
    """The job id of ``submitted: ID (NAME)``, as ``flengine admin KIT submit`` prints it."""
    submitted = re.search(r"^submitted: ([0-9a-f]+) ", stdout, re.M)
    assert submitted, stdout
    return submitted.group(1)


def assert_essential_steps(steps: list[Step], essential: list[str]) -> None:
    """The walk-through keeps the ``essential`` steps, in this order (other steps may come between)."""
    names = [step.name for step in steps]
    assert [name for name in names if name in essential] == essential, names


def assert_downloaded(folder: Path, printed: str, job_id: str) -> Path:
    """The results folder ``admin download`` printed (under ``folder``), checked: the job's, completed, whole."""
    downloaded = re.search(r"^downloaded to (\S+)$", printed, re.M)
    assert downloaded, printed
    results = folder / downloaded.group(1)
    assert results.name == job_id
    summary = json.loads((results / "summary.json").read_text(encoding="utf-8"))
    assert (summary["job_id"], summary["status"]) == (job_id, "FINISHED_COMPLETED")
    assert (results / "server" / "models" / "global.safetensors").is_file()
    assert sorted(path.name for path in results.iterdir() if path.is_dir()) == ["server", "site-1", "site-2"]
    return results
