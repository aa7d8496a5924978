"""The README's two set-up commands: CI runs the test one verbatim, and neither pulls CUDA torch."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def setup_commands() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the Set-up section has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_setup_has_exactly_two_commands() -> None:
    commands = setup_commands()

    assert len(commands) == 2
    assert commands[0].endswith("flengine validate jobs/fedavg") or commands[0].endswith("flengine run jobs/fedavg")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci_lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()

    assert setup_commands()[1] in ci_lines


def test_setup_pins_the_cpu_torch() -> None:
    # An unpinned torch on a machine without it pulls the newest release with GBs of CUDA packages.
    for command in setup_commands():
        assert "torch==2.13.0" in command.split()
