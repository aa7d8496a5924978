"""A site's results taken by the server: once per site even when announced concurrently, in time.

Every download here is a real one: the server's endpoint and the site's are cells on 127.0.0.1,
the site offers its packed results with its download service, the server pulls them.
"""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from engine.cells import CellSettings, Message, Reply
from engine.deploy import protocol, results
from engine.deploy.archive import JobArchiveError, archive_digest
from engine.deploy.job_store import JobRecord
from engine.errors import FlengineError, StreamingError
from engine.site import SiteEndpoint
from engine.streaming.service import CHANNEL, TOPIC_CHUNK
from tests.zip_directories import empty_members

#: Cells that notice a peer gone within about a second, on a free port.
SETTINGS = CellSettings(port=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
WAIT_S = 10.0
JOB_ID = "3f9c0a1b2c4d"


class Network:
    """The server's endpoint and the site endpoints of one test, all closed when it ends."""

    def __init__(self) -> None:
        self.server = SiteEndpoint("server", SETTINGS, None, {}).start()
        self.sites: list[SiteEndpoint] = []

    def site(self, name: str = "site-1") -> SiteEndpoint:
        """A new endpoint ``name``, connected to the server."""
        endpoint = SiteEndpoint(name, SETTINGS, None, {}, connect_to=self.server.cell.endpoint).start()
        self.sites.append(endpoint)
        assert endpoint.cell.wait_connected(WAIT_S), f"{name} did not connect"
        return endpoint

    def close(self) -> None:
        for endpoint in reversed(self.sites):
            endpoint.close()
        self.server.close()


@pytest.fixture
def network() -> Iterator[Network]:
    opened = Network()
    yield opened
    opened.close()


@pytest.fixture
def site(network: Network) -> SiteEndpoint:
    return network.site()


@pytest.fixture
def site_results(tmp_path: Path) -> Path:
    folder = tmp_path / "site-1-results"
    folder.mkdir()
    (folder / "log.txt").write_text("task done\n")
    return folder


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    folder = tmp_path / "jobs" / JOB_ID / "workspace"
    folder.mkdir(parents=True)
    return folder


def announce(site: SiteEndpoint, folder: Path) -> dict[str, Any]:
    """The site's "job ended" header: its results packed and offered to the server, as a site daemon does."""
    offer = results.offer_results(site, folder, "server")
    assert offer, "the site could not offer its results"
    return {"job_id": JOB_ID, "code": 0, **offer}


def serve_chunks_through(site: SiteEndpoint, step: Callable[[Message], object]) -> None:
    """Run ``step`` before the site's download service serves each chunk (it may hold or stop the site)."""
    service = site.service
    assert service is not None

    def chunk(message: Message) -> Reply:
        step(message)
        return service._on_chunk(message)

    site.cell.unregister_handler(CHANNEL, TOPIC_CHUNK)
    site.cell.register_handler(CHANNEL, TOPIC_CHUNK, chunk)


def job(status: str = "RUNNING", ended_s_ago: float | None = None) -> JobRecord:
    finished_at = None
    if ended_s_ago is not None:
        finished_at = (datetime.now(timezone.utc) - timedelta(seconds=ended_s_ago)).isoformat()
    return JobRecord(JOB_ID, "fedavg", "alice", "a", status, "2025-01-31T12:00:00+00:00", None, finished_at)


def test_results_are_pulled_from_the_site_into_the_job_workspace(
    network: Network, site: SiteEndpoint, site_results: Path, workspace: Path
) -> None:
    header = announce(site, site_results)

    taken = results.take_results(network.server, "site-1", header, workspace / "site-1")

    assert taken == workspace / "site-1" and (taken / "log.txt").read_text() == "task done\n"
    assert site.chunks_served == 1
    assert sorted(p.name for p in workspace.iterdir()) == ["site-1"]  # the claim is gone


def test_results_that_do_not_match_their_announced_digest_are_refused_and_leave_nothing(
    network: Network, site: SiteEndpoint, site_results: Path, workspace: Path
) -> None:
    header = {**announce(site, site_results), "digest": "0" * 64}

    with pytest.raises(
        FlengineError, match="^the results of site-1: its sha256 differs from the one its sender announced$"
    ):
        results.take_results(network.server, "site-1", header, workspace / "site-1")

    assert list(workspace.iterdir()) == []  # nothing unpacked, no claim left


def test_concurrent_announcements_of_one_site_cost_one_download(
    network: Network, site: SiteEndpoint, site_results: Path, workspace: Path
) -> None:
    header = announce(site, site_results)
    gate = threading.Event()
    serve_chunks_through(site, lambda message: gate.wait(WAIT_S))
    outcomes: list[object] = []
    landed = threading.Condition()

    def take() -> None:
        try:
            outcome: object = results.take_results(network.server, "site-1", header, workspace / "site-1")
        except FlengineError as e:
            outcome = str(e)
        with landed:
            outcomes.append(outcome)
            landed.notify_all()

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    with landed:  # the refusals come at once; the one download waits at the gate
        assert landed.wait_for(lambda: len(outcomes) == 3, WAIT_S), outcomes
    gate.set()
    for thread in threads:
        thread.join(WAIT_S)

    assert outcomes.count(workspace / "site-1") == 1
    assert sorted(o for o in outcomes if isinstance(o, str)) == ["results for site-1 are being taken already"] * 3
    assert site.chunks_served == 1  # the archive is one chunk: it was pulled once


def test_results_taken_once_are_refused_the_second_time(
    network: Network, site: SiteEndpoint, site_results: Path, workspace: Path
) -> None:
    header = announce(site, site_results)
    results.take_results(network.server, "site-1", header, workspace / "site-1")

    with pytest.raises(FlengineError, match=r"^results for site-1 were taken already$"):
        results.take_results(network.server, "site-1", announce(site, site_results), workspace / "site-1")
    assert site.chunks_served == 1  # refused before a byte was pulled


def test_a_site_that_goes_away_mid_download_frees_its_slot_for_a_retry(
    network: Network, site: SiteEndpoint, site_results: Path, workspace: Path
) -> None:
    header = announce(site, site_results)
    serve_chunks_through(site, lambda message: site.cell.stop())  # asked for the archive, the site stops

    with pytest.raises(StreamingError, match=rf"^download '{header['ref']}' from 'site-1': chunk 0 failed"):
        results.take_results(network.server, "site-1", header, workspace / "site-1")
    assert list(workspace.iterdir()) == []

    back = network.site()  # the site comes back and announces its results again
    taken = results.take_results(network.server, "site-1", announce(back, site_results), workspace / "site-1")

    assert (taken / "log.txt").read_text() == "task done\n"


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
    network: Network, site: SiteEndpoint, site_results: Path, workspace: Path, make, taken: bool
) -> None:
    record = make()
    header = announce(site, site_results)
    if taken:
        assert results.take_results(network.server, "site-1", header, workspace / "site-1", job=record)
    else:
        with pytest.raises(FlengineError, match=rf"^job {JOB_ID} ended more than 300 s ago; its sites' results"):
            results.take_results(network.server, "site-1", header, workspace / "site-1", job=record)
        assert site.chunks_served == 0 and list(workspace.iterdir()) == []
        assert site.service is not None and len(site.service.registry) == 1  # the offer was never pulled


def test_results_settle_once_the_window_closed_and_no_claim_is_open(workspace: Path) -> None:
    ended = job("FINISHED_COMPLETED", ended_s_ago=results.RESULTS_GRACE_S + 10)

    assert not results.results_settled(job("FINISHED_COMPLETED", ended_s_ago=1), workspace)
    assert results.results_settled(ended, workspace)
    (workspace / ".taking-site-1").mkdir()  # a download that began in time is still landing
    assert not results.results_settled(ended, workspace)


def test_a_results_archive_of_600000_empty_members_is_refused_before_a_member_list_is_built(
    network: Network, site: SiteEndpoint, workspace: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "offer"
    folder.mkdir()
    archive = empty_members(folder / "results.zip", 600_000)
    assert site.service is not None
    ref = site.service.add_file(archive, protocol.ARCHIVE_CHUNK_BYTES, ["server"], 60.0, owned_folder=folder)
    header = {
        "job_id": JOB_ID,
        "code": 0,
        "ref": ref,
        "size": archive.stat().st_size,
        "digest": archive_digest(archive),
    }

    tracemalloc.start()
    try:
        with pytest.raises(JobArchiveError, match=r"more than 10000 members \(600000 declared by its end record\)"):
            results.take_results(network.server, "site-1", header, workspace / "site-1")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak_bytes < 32 << 20, f"taking the results peaked at {peak_bytes >> 20} MiB"  # 600,000 ZipInfos: over 300
    assert not (workspace / "site-1").exists()
