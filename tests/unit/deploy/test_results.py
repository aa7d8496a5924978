"""A site's results taken by the server: once per site even when announced concurrently, fast enough, in time."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.deploy import results
from engine.deploy.archive import archive_digest, pack_job
from engine.deploy.job_store import JobRecord
from engine.errors import FlengineError, StreamingError
from engine.streaming.service import DEFAULT_MIN_THROUGHPUT

ENDPOINT = SimpleNamespace(cell=object())


class FakeDownloads:
    """Stands in for `download_file`: copies a prepared archive, optionally held at a gate or failing."""

    def __init__(self, archive: Path) -> None:
        self.archive = archive
        self.calls: list[dict[str, Any]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False
        self._lock = threading.Lock()

    def __call__(self, cell: object, source: str, ref: str, path: Path, **kwargs: Any) -> Path:
        with self._lock:
            self.calls.append(kwargs)
            fail, self.fail_next = self.fail_next, False
        assert self.gate.wait(10.0), "the test never opened the gate"
        if fail:
            raise StreamingError(f"download {ref!r} from {source!r} failed: the site went away")
        path.write_bytes(self.archive.read_bytes())
        return path


@pytest.fixture
def site_results(tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / "site-1-results"
    folder.mkdir()
    (folder / "log.txt").write_text("task done\n")
    archive = pack_job(folder, tmp_path / "results.zip")
    return archive, archive_digest(archive)


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch, site_results: tuple[Path, str]) -> FakeDownloads:
    fake = FakeDownloads(site_results[0])
    monkeypatch.setattr(results, "download_file", fake)
    return fake


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    folder = tmp_path / "jobs" / "3f9c0a1b2c4d" / "workspace"
    folder.mkdir(parents=True)
    return folder


def header(site_results: tuple[Path, str]) -> dict[str, Any]:
    archive, digest = site_results
    return {"job_id": "3f9c0a1b2c4d", "code": 0, "ref": "r1", "size": archive.stat().st_size, "digest": digest}


def job(status: str = "RUNNING", ended_s_ago: float | None = None) -> JobRecord:
    finished_at = None
    if ended_s_ago is not None:
        finished_at = (datetime.now(timezone.utc) - timedelta(seconds=ended_s_ago)).isoformat()
    return JobRecord("3f9c0a1b2c4d", "fedavg", "alice", "a", status, "2025-01-31T12:00:00+00:00", None, finished_at)


def test_results_are_pulled_with_the_engine_throughput_floor(
    downloads: FakeDownloads, site_results: tuple[Path, str], workspace: Path
) -> None:
    taken = results.take_results(ENDPOINT, "site-1", header(site_results), workspace / "site-1")

    assert taken == workspace / "site-1" and (taken / "log.txt").read_text() == "task done\n"
    assert downloads.calls[0]["min_throughput"] == DEFAULT_MIN_THROUGHPUT
    assert sorted(p.name for p in workspace.iterdir()) == ["site-1"]  # the claim is gone


def test_concurrent_announcements_of_one_site_cost_one_download(
    downloads: FakeDownloads, site_results: tuple[Path, str], workspace: Path
) -> None:
    downloads.gate.clear()
    outcomes: list[object] = []

    def take() -> None:
        try:
            outcomes.append(results.take_results(ENDPOINT, "site-1", header(site_results), workspace / "site-1"))
        except FlengineError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10.0
    while len(outcomes) < 3 and time.monotonic() < deadline:  # the refusals come at once; one waits at the gate
        time.sleep(0.01)
    downloads.gate.set()
    for thread in threads:
        thread.join(10.0)

    assert len(downloads.calls) == 1
    assert outcomes.count(workspace / "site-1") == 1
    assert sorted(o for o in outcomes if isinstance(o, str)) == ["results for site-1 are being taken already"] * 3


def test_results_taken_once_are_refused_the_second_time(
    downloads: FakeDownloads, site_results: tuple[Path, str], workspace: Path
) -> None:
    results.take_results(ENDPOINT, "site-1", header(site_results), workspace / "site-1")

    with pytest.raises(FlengineError, match=r"^results for site-1 were taken already$"):
        results.take_results(ENDPOINT, "site-1", header(site_results), workspace / "site-1")
    assert len(downloads.calls) == 1


def test_a_failed_download_frees_the_site_for_a_retry(
    downloads: FakeDownloads, site_results: tuple[Path, str], workspace: Path
) -> None:
    downloads.fail_next = True
    with pytest.raises(StreamingError, match="the site went away"):
        results.take_results(ENDPOINT, "site-1", header(site_results), workspace / "site-1")
    assert list(workspace.iterdir()) == []

    taken = results.take_results(ENDPOINT, "site-1", header(site_results), workspace / "site-1")

    assert (taken / "log.txt").is_file()


@pytest.mark.parametrize(
    ("make", "taken"),
    [  # records made when the test runs: a suite's collection can be minutes before it
        (lambda: job("RUNNING"), True),
        (lambda: job("FINISHED_COMPLETED", ended_s_ago=10), True),
        (lambda: job("FINISHED_ABORTED", ended_s_ago=results.RESULTS_GRACE_S + 10), False),
        (lambda: job("FINISHED_COMPLETED"), False),  # final with no end time: nothing more is taken
    ],
    ids=["running", "just-ended", "ended-long-ago", "no-end-time"],
)
def test_results_are_taken_only_while_the_job_runs_or_just_ended(
    downloads: FakeDownloads, site_results: tuple[Path, str], workspace: Path, make, taken: bool
) -> None:
    record = make()
    if taken:
        assert results.take_results(ENDPOINT, "site-1", header(site_results), workspace / "site-1", job=record)
    else:
        with pytest.raises(FlengineError, match=r"^job 3f9c0a1b2c4d ended more than 300 s ago; its sites' results"):
            results.take_results(ENDPOINT, "site-1", header(site_results), workspace / "site-1", job=record)
        assert downloads.calls == [] and list(workspace.iterdir()) == []


def test_results_settle_once_the_window_closed_and_no_claim_is_open(workspace: Path) -> None:
    ended = job("FINISHED_COMPLETED", ended_s_ago=results.RESULTS_GRACE_S + 10)

    assert not results.results_settled(job("FINISHED_COMPLETED", ended_s_ago=1), workspace)
    assert results.results_settled(ended, workspace)
    (workspace / ".taking-site-1").mkdir()  # a download that began in time is still landing
    assert not results.results_settled(ended, workspace)
