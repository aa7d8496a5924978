"""Fixtures shared by the integration tests that start real job processes."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.security import write_site_key_folders
from tests.integration.runtime.conftest import processes_mentioning

#: The clients of the hand-started jobs, whose keys the ``keys`` fixture writes.
KEYED_SITES = ["site-1", "site-2"]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Keys folders of the server and both sites, as the simulator writes them."""
    return write_site_key_folders(tmp_path / "keys", "server", KEYED_SITES)


@pytest.fixture
def no_leftovers(tmp_path: Path) -> Iterator[None]:
    """Fails a test that leaves a process mentioning its folder alive (and kills it)."""
    yield
    leftovers = processes_mentioning(str(tmp_path))
    for line in leftovers:
        subprocess.run(["kill", "-9", line.split(":", 1)[0]], check=False)
    assert leftovers == []
