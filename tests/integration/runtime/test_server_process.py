"""The server job as its own process, driven from outside: a result submitted twice counts once,
and a client keeps going when the server restarts on the same endpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.cells import CellSettings, Message, Reply
from engine.config import job_code_on_path
from engine.errors import CellRemoteError
from engine.model import FLModel, Shareable
from engine.model.convert import model_from_shareable, shareable_from_model
from engine.runtime import protocol
from engine.site import SiteEndpoint, SiteSettings
from tests.integration.conftest import KEYED_SITES
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import make_bench_job

STARTUP_S = 60.0
SITES = KEYED_SITES
FAST = CellSettings(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0)


def start_process(
    role: str, job: Path, workspace: Path, keys: dict[str, Path], *extra: str, site: str = "server"
) -> subprocess.Popen[str]:
    """One process of the job, as the simulator starts it."""
    command = [sys.executable, "-m", "engine.runtime.entry", role, "--job", str(job), "--workspace", str(workspace)]
    command += ["--site", site, "--keys", str(keys[site])]
    return subprocess.Popen([*command, *extra], stdout=subprocess.PIPE, text=True)


def wait_endpoint(server: subprocess.Popen[str]) -> str:
    """The endpoint from the server's ``listening`` event."""
    deadline = time.monotonic() + STARTUP_S
    assert server.stdout is not None
    for line in server.stdout:
        event = json.loads(line)
        if event["event"] == "listening":
            return str(event["endpoint"])
        assert time.monotonic() < deadline, "the server never reported its endpoint"
    raise AssertionError(f"the server exited with {server.wait()} before it listened")


def finish(process: subprocess.Popen[str], timeout_s: float = 60.0) -> int:
    """Wait for ``process`` (its stdout drained); kill it if it overstays."""
    try:
        process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return process.returncode


class HandDrivenClient:
    """A client that speaks the task protocol itself over a real cell, so a test can misbehave."""

    def __init__(self, site: str, endpoint: str, keys: Path) -> None:
        self.endpoint = SiteEndpoint.for_site(SiteSettings(site, FAST, keys), {}, connect_to=endpoint).start()
        self.cell = self.endpoint.cell
        assert self.cell.wait_connected(STARTUP_S), f"{site} never connected to {endpoint}"
        self.codec = self.endpoint.codec

    def ask(self) -> Message:
        """Ask the server for work once."""
        header = {protocol.HEADER_JOB_ID: "job"}  # the job id the server process runs (entry's default)
        return self.cell.request("server", protocol.TASK_CHANNEL, protocol.TOPIC_GET_TASK, header, timeout_s=10.0)

    def next_task(self) -> tuple[dict[str, Any], Shareable | None]:
        """Ask until the server hands out a task (header, data) or ends the run (header, None)."""
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            reply = self.ask()
            if reply.header["state"] == protocol.STATE_TASK:
                return reply.header, self.codec.decode(reply.frames)
            if reply.header["state"] == protocol.STATE_END:
                return reply.header, None
            time.sleep(0.05)
        raise AssertionError("no task within the start-up time")

    def submit(self, header: dict[str, Any], result: Shareable) -> str:
        frames = self.codec.encode(result, receivers=["server"])
        task = {"task_id": header["task_id"], "task_name": header["task_name"], protocol.HEADER_JOB_ID: "job"}
        reply = self.cell.request("server", protocol.TASK_CHANNEL, protocol.TOPIC_SUBMIT, task, frames, timeout_s=30.0)
        return str(reply.header["outcome"])

    def close(self) -> None:
        self.endpoint.close()


def bench_result(data: Shareable, k: int) -> Shareable:
    """What bench_client.py sends as site-k: every parameter + k * 0.001, weight k * 100."""
    model = model_from_shareable(data)
    params = {name: tensor + k * 0.001 for name, tensor in model.params.items()}
    return shareable_from_model(FLModel(params=params, meta={"NUM_STEPS_CURRENT_ROUND": k * 100}))


def test_a_result_submitted_twice_is_counted_once(tmp_path: Path, keys: dict[str, Path], no_leftovers: None) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, layers=1, width=8)
    workspace = tmp_path / "workspace"
    server = start_process("server", job, workspace, keys, "--clients", "site-1,site-2")
    clients = []
    try:
        endpoint = wait_endpoint(server)
        clients = [HandDrivenClient(site, endpoint, keys[site]) for site in SITES]
        # the right site, but a process of another job (a late one on a reused port): refused
        stale = (
            clients[0]
            .cell.request_async(
                "server", protocol.TASK_CHANNEL, protocol.TOPIC_GET_TASK, {protocol.HEADER_JOB_ID: "another-job"}
            )
            .result(10.0)
        )
        for client in clients:  # the first workflow starts once every client asked for work
            assert client.ask().header["state"] == protocol.STATE_WAIT
        tasks = [client.next_task() for client in clients]
        initial = model_from_shareable(tasks[0][1]).params

        second = bench_result(tasks[1][1], 2)
        outcomes = [clients[1].submit(tasks[1][0], second), clients[1].submit(tasks[1][0], second)]
        outcomes.append(clients[0].submit(tasks[0][0], bench_result(tasks[0][1], 1)))
        ends = [client.next_task() for client in clients]
    finally:
        for client in clients:
            client.close()
        code = finish(server)

    assert stale.reason == "site-1 is not a client of this job (job)"
    assert outcomes == ["ACCEPTED", "DUPLICATE", "ACCEPTED"]
    assert [data for _, data in ends] == [None, None]
    assert code == 0
    final = load_file(workspace / "server" / "models" / "global.safetensors")
    delta = (1 * 0.001 * 100 + 2 * 0.001 * 200) / (100 + 200)  # site-2 once, not twice
    for name, tensor in initial.items():
        assert torch.allclose(final[name].double(), tensor.double() + delta, rtol=0, atol=1e-6), name
    assert read_json(workspace / "server" / "result.json")["state"] == "FINISHED_COMPLETED"


def test_the_server_tells_a_waiting_client_when_its_task_is_scheduled(
    tmp_path: Path, keys: dict[str, Path], no_leftovers: None
) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, layers=1, width=8)
    workspace = tmp_path / "workspace"
    server = start_process("server", job, workspace, keys, "--clients", "site-1")
    client = None
    try:
        endpoint = wait_endpoint(server)
        client = HandDrivenClient("site-1", endpoint, keys["site-1"])
        told = threading.Event()
        client.cell.register_handler(protocol.TASK_CHANNEL, protocol.TOPIC_TASK_READY, lambda message: told.set())
        first = client.ask()  # the workflow starts once every client asked; its task comes after
        assert told.wait(STARTUP_S), "no task-ready notice"
        second = client.ask()
        assert second.header["state"] == protocol.STATE_TASK  # the notice comes once the task is there
        outcome = client.submit(second.header, bench_result(client.codec.decode(second.frames), 1))
    finally:
        if client is not None:
            client.close()
        code = finish(server)

    assert first.header["state"] == protocol.STATE_WAIT
    assert outcome == "ACCEPTED"
    assert code == 0


def test_a_waiting_client_asks_again_as_soon_as_it_is_told_a_task_is_ready(
    tmp_path: Path, keys: dict[str, Path], no_leftovers: None
) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, num_clients=1, layers=1, width=8)
    stand_in = SiteEndpoint.for_site(SiteSettings("server", FAST, keys["server"]), {})
    server = stand_in.cell
    server.start()
    asks: list[float] = []
    replies = [
        Reply(header={"state": protocol.STATE_WAIT, "retry_s": 30.0}),  # without the notice: 30 s
        Reply(header={"state": protocol.STATE_END}),
    ]

    def get_task(message: Message) -> Reply:
        asks.append(time.monotonic())
        return replies[min(len(asks), len(replies)) - 1]

    server.register_handler(protocol.TASK_CHANNEL, protocol.TOPIC_GET_TASK, get_task)
    client = start_process("client", job, tmp_path / "workspace", keys, "--connect", server.endpoint, site="site-1")
    try:
        deadline = time.monotonic() + STARTUP_S
        while not asks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert asks, "the client never asked for work"
        time.sleep(0.3)  # it is now waiting out its retry time
        server.send("site-1", protocol.TASK_CHANNEL, protocol.TOPIC_TASK_READY)
        code = finish(client, timeout_s=20.0)
    finally:
        server.stop()

    assert code == 0
    assert len(asks) == 2 and asks[1] - asks[0] < 5.0  # woken by the notice, not after 30 s


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_client_carries_on_when_the_server_restarts(
    tmp_path: Path, keys: dict[str, Path], no_leftovers: None
) -> None:
    port = free_port()
    job = make_bench_job(
        tmp_path,
        num_rounds=2,
        layers=1,
        width=8,
        server_extra=f"cell {{ port = {port} }}\n",
    )
    first_ws, second_ws = tmp_path / "first", tmp_path / "second"
    clients = ["--clients", "site-1,site-2"]
    crashed = start_process("server", job, first_ws, keys, *clients)
    site1 = None
    try:
        endpoint = wait_endpoint(crashed)
        site1 = start_process("client", job, second_ws, keys, "--connect", endpoint, site="site-1")
        # site-1 is asking for work (the server waits for site-2); then the server dies.
        log = first_ws / "server" / "log.txt"
        deadline = time.monotonic() + STARTUP_S
        while "client asked for work site=site-1" not in _text(log) and time.monotonic() < deadline:
            time.sleep(0.1)
        crashed.kill()
        finish(crashed)
        time.sleep(1.0)  # site-1 keeps asking a server that is not there

        server = start_process("server", job, second_ws, keys, *clients)
        assert wait_endpoint(server) == endpoint
        site2 = start_process("client", job, second_ws, keys, "--connect", endpoint, site="site-2")
        codes = {"server": finish(server), "site-1": finish(site1), "site-2": finish(site2)}
    finally:
        for process in (crashed, site1):
            if process is not None and process.poll() is None:
                process.kill()
                finish(process)

    assert codes == {"server": 0, "site-1": 0, "site-2": 0}
    assert read_json(second_ws / "server" / "result.json")["state"] == "FINISHED_COMPLETED"
    assert read_json(second_ws / "site-1" / "process.json")["tasks_done"] == 2
    assert "server not reachable, retrying" in _text(second_ws / "site-1" / "log.txt")
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        names = set(BenchNet(layers=1, width=8).state_dict())
    assert set(load_file(second_ws / "server" / "models" / "global.safetensors")) == names


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.exists() else ""


def test_results_the_server_did_not_ask_for_are_refused_before_a_byte_is_pulled(
    tmp_path: Path, keys: dict[str, Path], no_leftovers: None
) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, min_clients=1, layers=1, width=8)
    workspace = tmp_path / "workspace"
    server = start_process("server", job, workspace, keys, "--clients", "site-1,site-2")
    clients = []
    try:
        endpoint = wait_endpoint(server)
        clients = [HandDrivenClient(site, endpoint, keys[site]) for site in SITES]
        for client in clients:
            assert client.ask().header["state"] == protocol.STATE_WAIT
        tasks = [client.next_task() for client in clients]
        huge = shareable_from_model(FLModel(params={"w": torch.ones(8 << 20)}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
        outcomes = {
            "site-2 answers site-1's task": clients[1].submit(tasks[0][0], bench_result(tasks[0][1], 2)),
            "a task never given": clients[0].submit({**tasks[0][0], "task_id": "no-such-task"}, huge),
        }
        with pytest.raises(
            CellRemoteError,
            match=r"announced \d+ bytes, more than a result of site-1 \(at most 2 x the 288 bytes it was sent\) may hold",
        ):
            clients[0].submit(tasks[0][0], huge)
        pulled = [client.endpoint.chunks_served for client in clients]
        outcomes["honest"] = [clients[k].submit(tasks[k][0], bench_result(tasks[k][1], k + 1)) for k in (0, 1)]
    finally:
        for client in clients:
            client.close()
        code = finish(server)

    assert outcomes == {
        "site-2 answers site-1's task": "LATE",
        "a task never given": "LATE",
        "honest": ["LATE", "ACCEPTED"],  # site-1's task failed with its refused result; the round goes on
    }
    assert pulled == [0, 0]
    assert code == 0
    assert read_json(workspace / "server" / "result.json")["state"] == "FINISHED_COMPLETED"
