"""A worker's key speaks for its own virtual clients only, against a real server job over CURVE."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from engine.cells import Cell, CellSettings
from engine.config import load_job
from engine.errors import CellError
from engine.runtime import protocol
from engine.runtime.server import ServerJob
from engine.runtime.workers import WorkerPlan
from engine.security import load_cell_security, write_site_key_folders
from engine.site import SiteSettings

REPO = Path(__file__).resolve().parents[3]


def test_a_worker_asks_for_its_own_clients_and_cannot_act_for_another_workers(tmp_path: Path) -> None:
    plan = WorkerPlan.round_robin([f"site-{i}" for i in range(1, 5)], 2)  # worker-1: sites 1, 3
    keys = write_site_key_folders(tmp_path / "keys", "server", list(plan.workers))
    events: queue.Queue[dict] = queue.Queue()
    site = SiteSettings("server", CellSettings(host="127.0.0.1", port=0), keys["server"])
    server = ServerJob(
        load_job(REPO / "jobs" / "fedavg"), site, tmp_path / "server", list(plan.clients), "job-1",
        report=lambda event, **fields: events.put({"event": event, **fields}), workers=plan.workers,
    )  # fmt: skip
    (tmp_path / "server").mkdir()
    runner = threading.Thread(target=server.run, daemon=True)
    runner.start()
    endpoint = next(e for e in iter(lambda: events.get(timeout=30), None) if e["event"] == "listening")["endpoint"]
    cells = []

    def connect(name: str) -> Cell:
        security = load_cell_security(keys["worker-1"], "worker-1", server=False)
        cell = Cell(name, CellSettings(heartbeat_timeout_s=5.0), connect_to=endpoint, security=security).start()
        cells.append(cell)
        return cell

    try:
        worker = connect("worker-1")
        assert worker.wait_connected(10.0)
        work = worker.request(
            "server", protocol.TASK_CHANNEL, protocol.TOPIC_GET_WORK, {"job_id": "job-1"}, timeout_s=10.0
        )
        assert work.header["state"] in (protocol.STATE_WAIT, protocol.STATE_TASK)
        assert set(work.header.get("clients", [])) <= {"site-1", "site-3"}

        own = connect("site-3")
        assert own.wait_connected(10.0)  # its own client: the server lets its key speak for it
        stolen = connect("site-2")  # worker-2's client
        assert not stolen.wait_connected(3.0) and "may not send as 'site-2'" in (stolen.link_error or "")

        for asker, topic in ((worker, protocol.TOPIC_GET_TASK), (own, protocol.TOPIC_GET_WORK)):
            try:  # a worker is no client, a client is no worker
                reply = asker.request("server", protocol.TASK_CHANNEL, topic, {"job_id": "job-1"}, timeout_s=10.0)
                refused = reply.header.get("outcome") == "FAILED"
            except CellError as e:
                refused = "not a" in str(e)
            assert refused, topic
    finally:
        server.abort("test over")
        for cell in cells:
            cell.stop()
        runner.join(30.0)
    assert not runner.is_alive()
