"""The README's tutorial, run as a newcomer runs it: every command of its code blocks, in order.

The commands are read from the README, not copied here, so the tutorial cannot drift from what
works. They run in a fresh folder where ``jobs/`` is the repository's, as from the repository root.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_docs import flengine_commands

REPO = Path(__file__).resolve().parents[2]
#: Seconds one tutorial command may take (a job run on a busy 2-core machine included).
COMMAND_TIMEOUT_S = 300


def tutorial_commands() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Tutorial\n", 1)[1].split("\n## ", 1)[0]
    blocks = "".join(part for i, part in enumerate(section.split("```")) if i % 2 == 1)
    return list(flengine_commands(f"```\n{blocks}```\n"))


@pytest.mark.slow
def test_the_tutorial_runs_from_top_to_bottom(tmp_path: Path) -> None:
    (tmp_path / "jobs").symlink_to(REPO / "jobs", target_is_directory=True)
    commands = tutorial_commands()
    assert [command.split()[1] for command in commands] == ["run", "new", "validate", "run", "report"]

    for command in commands:
        done = subprocess.run(
            [sys.executable, "-m", "engine", *shlex.split(command)[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"

    summary = json.loads((tmp_path / "runs" / "first" / "summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "FINISHED_COMPLETED"
    assert (tmp_path / "runs" / "first" / "server" / "models" / "global.safetensors").is_file()
    assert (tmp_path / "my-job" / "app" / "custom" / "train.py").is_file()
    assert (tmp_path / "runs" / "first" / "report.html").is_file()
