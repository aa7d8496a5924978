"""Fixtures of the runtime tests: run a job with the simulator, and check that no process outlives it."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.runtime.simulator import SimulationResult, run_simulation


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes (other than this one) that mention ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.fixture
def simulate(tmp_path: Path):
    """Run a job folder with the simulator; assert afterwards that no process of it is left."""

    def run(job: Path, n_clients: int | None = None, allowed_dirs: Sequence[Path] = ()) -> tuple[SimulationResult, str]:
        out = io.StringIO()
        result = run_simulation(job, n_clients, tmp_path / "workspace", out=out, allowed_dirs=allowed_dirs)
        return result, out.getvalue()

    yield run
    assert processes_mentioning(str(tmp_path)) == []


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
