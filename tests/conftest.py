"""Fixtures shared by the unit and integration tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cells.log_limit import REFUSALS


@pytest.fixture(autouse=True)
def refusals_logged_afresh() -> None:
    """Each test sees every refusal line: the process-wide log limiter starts over."""
    REFUSALS.reset()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (skipped where this machine does not let the tests mount one)."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
