"""`DownloadProgress`: rate-limited download_progress events from the download service's byte counts."""

from __future__ import annotations

from engine.runtime.transfer_progress import DownloadProgress, served_to


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_events_count_from_the_task_and_come_at_most_every_interval() -> None:
    clock = _Clock()
    progress = DownloadProgress(interval_s=0.5, clock=clock)
    progress.sent("t1", "site-1", 100, {"site-1": 1000})  # served before this task: not counted

    first = progress.poll({"site-1": 1030})
    clock.now = 0.2
    too_soon = progress.poll({"site-1": 1060})
    clock.now = 0.6
    later = progress.poll({"site-1": 1060})
    unchanged = progress.poll({"site-1": 1060})

    assert first == [{"site": "site-1", "task_id": "t1", "bytes": 30, "total": 100}]
    assert too_soon == [] and unchanged == []
    assert later == [{"site": "site-1", "task_id": "t1", "bytes": 60, "total": 100}]


def test_a_complete_download_is_said_at_once_and_then_dropped() -> None:
    clock = _Clock()
    progress = DownloadProgress(interval_s=10.0, clock=clock)
    progress.sent("t1", "site-1", 100, {})
    progress.poll({"site-1": 10})

    done = progress.poll({"site-1": 150})  # more than the task (another download too): capped
    after = progress.poll({"site-1": 300})

    assert done == [{"site": "site-1", "task_id": "t1", "bytes": 100, "total": 100}]
    assert after == []


def test_ended_and_empty_tasks_give_no_events() -> None:
    progress = DownloadProgress(interval_s=0.0)
    progress.sent("t1", "site-1", 100, {})
    progress.sent("t2", "site-2", 0, {})  # nothing to stream (a control task)

    progress.ended("t1")

    assert progress.poll({"site-1": 50, "site-2": 50}) == []


def test_served_to_counts_the_sites_own_cells_only() -> None:
    served = {"site-1": 5, "site-1.script": 7, "site-10": 100, "server": 1}

    assert served_to(served, "site-1") == 12
