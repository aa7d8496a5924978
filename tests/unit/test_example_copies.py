"""The digits example code has one source, `engine/templates/custom/`; the jobs under jobs/ carry copies.

A job folder must run as it is (it is what a site receives), so each of jobs/fedavg,
jobs/fedavg_sag and jobs/swarm holds the example's code; this test keeps those copies identical
to the source, so a fix lands in one place and the test names every copy to refresh.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "engine" / "templates" / "custom"
FILES = sorted(p.relative_to(SOURCE) for p in SOURCE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


@pytest.mark.parametrize("job", ["fedavg", "fedavg_sag", "swarm"])
def test_each_job_carries_the_example_code_unchanged(job: str) -> None:
    custom = REPO / "jobs" / job / "app" / "custom"

    stale = [str(name) for name in FILES if (custom / name).read_bytes() != (SOURCE / name).read_bytes()]

    assert FILES and not stale, f"copy engine/templates/custom/{{{', '.join(stale)}}} to jobs/{job}/app/custom/"
