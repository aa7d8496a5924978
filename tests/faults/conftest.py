"""The fault suite: real processes, each fault at a precise point (a test hook, a signal), never a sleep and a hope.

Each test records what the job did about its fault through the `fault_figures` fixture;
``tools/fault_table.py`` runs the suite with ``FLENGINE_FAULT_FIGURES=FILE`` set and makes the
table of docs/reliability.md from those records.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.runtime.conftest import simulate  # noqa: F401 - the fixture, shared

#: Where the figures of a run of the suite go (one JSON line per fault), when set.
FIGURES_ENV = "FLENGINE_FAULT_FIGURES"


class FaultFigures:
    """What one fault test measured: the row it adds to the fault table."""

    def __init__(self, test: str) -> None:
        self.test = test
        self.rows: list[dict[str, Any]] = []

    def record(
        self,
        fault: str,
        outcome: str,
        *,
        recover_s: float | None = None,
        rounds_lost: int | None = None,
        exact: bool | None = None,
        leftovers: str = "none",
    ) -> None:
        """Keep one row; ``recover_s`` from the fault to the job training normally again (None: it ended)."""
        assert recover_s is None or recover_s >= 0, recover_s
        self.rows.append(
            {
                "test": self.test,
                "fault": fault,
                "outcome": outcome,
                "recover_s": None if recover_s is None else round(recover_s, 2),
                "rounds_lost": rounds_lost,
                "exact": exact,
                "leftovers": leftovers,
            }
        )


@pytest.fixture
def fault_figures(request: pytest.FixtureRequest) -> Iterator[FaultFigures]:
    figures = FaultFigures(request.node.nodeid)
    yield figures
    path = os.environ.get(FIGURES_ENV)
    if path and figures.rows and not getattr(request.node, "rep_failed", False):
        with Path(path).open("a", encoding="utf-8") as stream:
            for row in figures.rows:
                stream.write(json.dumps(row) + "\n")


def events_of(path: Path) -> list[dict]:
    """The JSON events of an events.jsonl file (a line being written is skipped)."""
    events = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def first_after(events: list[dict], name: str, at: float, where=lambda event: True) -> dict:
    """The first ``name`` event at or after time ``at`` for which ``where(event)`` holds."""
    return next(e for e in events if e.get("event") == name and e.get("at", 0) >= at and where(e))


def wait_for_event(path: Path, name: str, timeout_s: float = 60.0) -> dict:
    """The first ``name`` event of an events.jsonl file, waiting for it up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [event for event in events_of(path) if event.get("event") == name]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {name} event in {path}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    if outcome.get_result().failed:  # a failed test's figures are not the engine's
        item.rep_failed = True  # type: ignore[attr-defined]
