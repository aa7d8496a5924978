"""What one site can do to the others through a real server job (CURVE, the jobs/fedavg example).

Each test runs a `ServerJob` in a thread and plays its sites with cells of their own keys: one
honest, one that misbehaves within what its key allows.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.cells import Cell, CellSettings, Message
from engine.cells.log_limit import REFUSALS
from engine.config import load_job
from engine.errors import CellRemoteError
from engine.model import Shareable, model_from_shareable
from engine.model.ccwf import CCWF_CHANNEL, TOPIC_STATUS, WorkflowStatus
from engine.runtime import protocol, result_intake
from engine.runtime.assembly import streaming_settings
from engine.runtime.server import ServerJob
from engine.security import load_cell_security, write_site_key_folders
from engine.site import SiteEndpoint, SiteSettings
from engine.streaming.service import CHANNEL, TOPIC_INFO

REPO = Path(__file__).resolve().parents[3]
SITES = ["site-1", "site-2"]


@dataclass
class Job:
    server: ServerJob
    endpoint: str
    keys: dict[str, Path]
    tmp: Path
    folder: Path = REPO / "jobs" / "fedavg"

    def site(self, name: str) -> SiteEndpoint:
        stream = streaming_settings(load_job(self.folder).app_for(name).client.data)
        settings = SiteSettings(name, CellSettings(heartbeat_timeout_s=30), self.keys[name])
        site = SiteEndpoint.for_site(settings, stream, connect_to=self.endpoint, workspace=self.tmp).start()
        assert site.cell.wait_connected(10)
        return site


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    yield from running(tmp_path, REPO / "jobs" / "fedavg")


def running(tmp_path: Path, folder: Path) -> Iterator[Job]:
    """The server job of ``folder`` running in a thread, until the test is over."""
    keys = write_site_key_folders(tmp_path / "keys", "server", SITES)
    events: queue.Queue[dict] = queue.Queue()
    (tmp_path / "server").mkdir()
    server = ServerJob(
        load_job(folder),
        SiteSettings("server", CellSettings(host="127.0.0.1", port=0), keys["server"]),
        tmp_path / "server",
        SITES,
        "job-1",
        report=lambda event, **fields: events.put({"event": event, **fields}),
    )
    runner = threading.Thread(target=server.run, daemon=True)
    runner.start()
    endpoint = next(e for e in iter(lambda: events.get(timeout=30), None) if e["event"] == "listening")["endpoint"]
    try:
        yield Job(server, endpoint, keys, tmp_path, folder)
    finally:
        server.abort("test over")
        runner.join(30)


def ask(cell: Cell, topic: str, **header: object) -> Message:
    header = {protocol.HEADER_JOB_ID: "job-1", protocol.HEADER_REQUEST_ID: uuid.uuid4().hex, **header}
    return cell.request("server", protocol.TASK_CHANNEL, topic, header, timeout_s=120)


def tasks_of(*sites: SiteEndpoint) -> list[Message]:
    """Each site's task of the first round (the workflow starts once both have asked)."""
    for site in sites:
        ask(site.cell, protocol.TOPIC_GET_TASK)
    return [task_of(site) for site in sites]


def task_of(site: SiteEndpoint) -> Message:
    for _ in range(300):
        reply = ask(site.cell, protocol.TOPIC_GET_TASK)
        if reply.header.get("state") == protocol.STATE_TASK:
            return reply
        time.sleep(0.1)
    raise AssertionError(f"{site.cell.fqcn} got no task")


def submit(site: SiteEndpoint, task: Message) -> Message:
    frames = site.codec.encode(Shareable(), receivers=["server"])
    header = {protocol.HEADER_JOB_ID: "job-1", protocol.HEADER_REQUEST_ID: uuid.uuid4().hex, **task.header}
    return site.cell.request("server", protocol.TASK_CHANNEL, protocol.TOPIC_SUBMIT, header, frames, timeout_s=120)


def test_a_site_that_keeps_its_model_download_alive_holds_another_sites_result_a_bounded_time(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """site-2 asks for the round model's info now and then and never finishes: site-1's result
    (folded in memory, which waits for the model's downloads to end) is taken all the same."""
    monkeypatch.setattr(result_intake, "FOLD_WAIT_LONGEST_S", 2.0)
    honest, trickler = job.site("site-1"), job.site("site-2")
    try:
        mine, theirs = tasks_of(honest, trickler)
        honest.codec.decode(mine.frames, sender="server")  # site-1 pulls its model as a client does
        owner, refs = job.server._task_offers[theirs.header["task_id"]]  # what site-2's task frames name
        assert owner == "site-2"
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.5):
                for ref in refs:
                    trickler.cell.request("server", CHANNEL, TOPIC_INFO, {"ref": ref}, timeout_s=10)

        threading.Thread(target=trickle, daemon=True).start()
        started = time.monotonic()
        try:
            submit(honest, mine)
            answered_s = time.monotonic() - started
        finally:
            stop.set()
        assert answered_s < 10, f"site-1's result waited {answered_s:.1f} s on site-2"  # 2 s, plus the round's work
    finally:
        honest.close()
        trickler.close()


def test_a_site_cannot_unhook_another_sites_task_data_by_its_task_id(job: Job) -> None:
    """The data sent to all holds the first client's task id; a result sent under it by another
    site is LATE and leaves that client's downloads as they were (waited for, judged)."""
    first, other = job.site("site-1"), job.site("site-2")
    try:
        mine, _ = tasks_of(first, other)
        before = job.server._task_offers[mine.header["task_id"]]

        reply = submit(other, mine)

        assert reply.header.get("outcome") == "LATE"
        assert job.server._task_offers[mine.header["task_id"]] == before
    finally:
        first.close()
        other.close()


def test_cells_that_are_not_clients_leave_nothing_in_the_servers_memory(job: Job) -> None:
    """A site's key owns every ``site-2.<name>``: each such cell is refused, and is kept nowhere."""
    security = load_cell_security(job.keys["site-2"], "site-2", server=False)
    for index in range(5):
        cell = Cell(f"site-2.guest-{index}", CellSettings(), connect_to=job.endpoint, security=security).start()
        try:
            assert cell.wait_connected(10), cell.link_error
            for topic in (protocol.TOPIC_GET_TASK, protocol.TOPIC_SUBMIT):
                with pytest.raises(CellRemoteError, match="is not a client of this job"):
                    ask(cell, topic, task_id="x")
        finally:
            cell.stop()
    assert job.server.repeats.sites() == set()


def test_status_reports_of_workflows_the_job_does_not_run_are_not_kept(
    job: Job, caplog: pytest.LogCaptureFixture
) -> None:
    """Each report is kept under the workflow it names: a site naming a new one each time (with a
    MiB of rounds in each) would grow the server's memory without end. Only the job's are kept."""
    REFUSALS.reset()
    site = job.site("site-2")
    try:
        with caplog.at_level(logging.WARNING, logger="engine.runtime.server"):
            for index in range(5):
                status = WorkflowStatus(f"swarm-{index}", round=0, rounds_done=[{"round": 0}] * 1000)
                site.cell.send("server", CCWF_CHANNEL, TOPIC_STATUS, status.to_header())
            deadline = time.monotonic() + 10
            while caplog.text.count("ignored: no workflow") < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert caplog.text.count("ignored: no workflow") == 5, caplog.text
        assert "status report of site-2 ignored: no workflow 'swarm-4' in this job" in caplog.text
        assert job.server._status == {}
    finally:
        site.close()


FOREVER = """
import threading

import torch

from engine.controller import Controller, Task
from engine.model import FLModel, shareable_from_model


class Forever(Controller):
    def run(self) -> None:
        task = Task("train", shareable_from_model(FLModel(params={"w": torch.arange(100000.0)})), timeout=120)
        self.broadcast_forever(task)
        self.abort_signal.wait()


class ShortTask(Controller):
    def run(self) -> None:
        task = Task("train", shareable_from_model(FLModel(params={"w": torch.arange(100000.0)})), timeout=1)
        self.broadcast_and_wait(task, min_responses=0)
        self.abort_signal.wait()
"""


def with_workflow(tmp_path: Path, code: str, workflow: str) -> Path:
    """jobs/fedavg with ``workflow`` (a class of ``code``, in custom/forever.py) as its only workflow."""
    folder = tmp_path / "forever"
    shutil.copytree(REPO / "jobs" / "fedavg", folder)
    (folder / "app" / "custom" / "forever.py").write_text(code)
    server_conf = folder / "app" / "config" / "config_fed_server.conf"
    text = server_conf.read_text()
    start, end = text.index("workflows = ["), text.index("components = [")
    server_conf.write_text(text[:start] + f"workflows = [{{ id = w, path = forever.{workflow} }}]\n\n" + text[end:])
    return folder


@pytest.fixture
def forever_job(tmp_path: Path) -> Iterator[Job]:
    yield from running(tmp_path, with_workflow(tmp_path, FOREVER, "Forever"))


@pytest.fixture
def short_task_job(tmp_path: Path) -> Iterator[Job]:
    yield from running(tmp_path, with_workflow(tmp_path, FOREVER, "ShortTask"))


def test_a_task_broadcast_for_ever_is_pulled_anew_each_time_a_site_takes_it_again(forever_job: Job) -> None:
    """Each site pulls a download once: a site that takes the same task again gets a download of
    its own, pulled even after the first one was freed (every receiver done with it)."""
    sites = [forever_job.site(name) for name in SITES]
    try:
        first = tasks_of(*sites)
        for site, task in zip(sites, first, strict=True):
            model = site.codec.decode(task.frames, sender="server")  # each pulls, and reports done
            assert model_from_shareable(model).params["w"][-1].item() == 99999.0
            submit(site, task)
        deadline = time.monotonic() + 10
        while len(forever_job.server.endpoint.service.registry) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(forever_job.server.endpoint.service.registry) == 0  # the shared download is freed

        for _ in range(3):
            again = task_of(sites[0])
            assert again.header["task_id"] != first[0].header["task_id"]
            model = sites[0].codec.decode(again.frames, sender="server")
            assert model_from_shareable(model).params["w"][-1].item() == 99999.0
            submit(sites[0], again)
    finally:
        for site in sites:
            site.close()


def test_a_task_never_handed_in_leaves_nothing_of_its_data_behind(short_task_job: Job) -> None:
    """Both sites take a task (1 s timeout) and never answer: what the server kept to wait for
    their downloads is dropped once the task ends, not at the end of the job."""
    sites = [short_task_job.site(name) for name in SITES]
    try:
        tasks_of(*sites)
        assert len(short_task_job.server._task_offers) == 2
        deadline = time.monotonic() + 10
        while short_task_job.server._task_offers and time.monotonic() < deadline:
            time.sleep(0.1)
        assert short_task_job.server._task_offers == {}
    finally:
        for site in sites:
            site.close()
