"""`WorkerPlan`: which worker runs which virtual clients, written by the simulator and read as data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import UsageError
from engine.runtime.workers import SITES_FILE, WorkerPlan


def test_round_robin_spreads_the_clients_over_the_workers_in_order() -> None:
    clients = [f"site-{i}" for i in range(1, 8)]

    plan = WorkerPlan.round_robin(clients, 3)

    assert plan.workers == {
        "worker-1": ("site-1", "site-4", "site-7"),
        "worker-2": ("site-2", "site-5"),
        "worker-3": ("site-3", "site-6"),
    }
    assert plan.worker_of("site-5") == "worker-2" and plan.worker_of("site-9") is None
    assert list(WorkerPlan.round_robin(clients[:2], 4).workers) == ["worker-1", "worker-2"]  # no idle worker


def test_a_plan_survives_its_file(tmp_path: Path) -> None:
    plan = WorkerPlan.round_robin([f"site-{i}" for i in range(1, 10_001)], 4)

    again = WorkerPlan.read(plan.write(tmp_path))

    assert again == plan and len(again.clients) == 10_000


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"clients": ["site-1", "site-2"], "workers": {"worker-1": ["site-1"]}}, "without a worker"),
        ({"clients": ["site-1"], "workers": {"worker-1": ["site-1"], "worker-2": ["site-1"]}}, "given to both"),
        ({"clients": ["site-1", "site-1"], "workers": {"worker-1": ["site-1"]}}, "listed twice"),
        ({"clients": ["site-1"], "workers": {"site-1": ["site-1"]}}, "has the name of a site"),
        ({"clients": ["site-1"], "workers": {"server": ["site-1"]}}, "has the name of a site"),
        ({"clients": ["../etc"], "workers": {"worker-1": ["../etc"]}}, "not a site name"),
        ({"clients": [7], "workers": {"worker-1": [7]}}, "not a site name"),
        ({"clients": "site-1", "workers": {}}, "expected"),
        ({"workers": {}}, "not a worker plan"),
    ],
)
def test_a_bad_plan_file_is_refused_naming_it(tmp_path: Path, record: dict, match: str) -> None:
    path = tmp_path / SITES_FILE
    path.write_text(json.dumps(record), encoding="utf-8")

    with pytest.raises(UsageError, match=match) as caught:
        WorkerPlan.read(path)

    assert str(path) in str(caught.value)


def test_a_missing_or_non_json_plan_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a worker plan"):
        WorkerPlan.read(tmp_path / "missing.json")
    (tmp_path / SITES_FILE).write_text("{", encoding="utf-8")
    with pytest.raises(UsageError, match="not a worker plan"):
        WorkerPlan.read(tmp_path / SITES_FILE)


def test_no_workers_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="at least 1 worker"):
        WorkerPlan.round_robin(["site-1"], 0)
