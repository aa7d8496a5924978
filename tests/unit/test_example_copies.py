"""The digits example has one home: its data and model in `engine.examples.digits`, its training script in
`engine/templates/custom/`; the jobs under jobs/ carry copies of the script only.

A job folder must run as it is (it is what a site receives), so each job holds the training
script, which imports the data and the model from `engine.examples.digits` (its persistor names
``engine.examples.digits.Net``); this test keeps every job's copy identical to the source, so a
fix lands in one place and the test names every copy to refresh.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "engine" / "templates" / "custom"
FILES = sorted(p.relative_to(SOURCE) for p in SOURCE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
JOBS = sorted(p.parent.parent.name for p in (REPO / "jobs").glob("*/app/custom"))


def test_every_example_job_is_checked() -> None:
    assert {"fedavg", "fedavg_sag", "swarm"} <= set(JOBS)


@pytest.mark.parametrize("job", JOBS)
def test_each_job_carries_the_example_code_unchanged(job: str) -> None:
    custom = REPO / "jobs" / job / "app" / "custom"
    carried = sorted(p.relative_to(custom) for p in custom.rglob("*") if p.is_file() and "__pycache__" not in p.parts)

    stale = [str(name) for name in FILES if (custom / name).read_bytes() != (SOURCE / name).read_bytes()]

    assert carried == FILES, f"jobs/{job}/app/custom/ should hold exactly {[str(f) for f in FILES]}"
    assert FILES and not stale, f"copy engine/templates/custom/{{{', '.join(stale)}}} to jobs/{job}/app/custom/"
