"""A client's network cut while it pulls its model, shorter and longer than the heartbeat timeout
(real processes in network namespaces whose link the test takes down; the cut starts when the
site's script is about to pull its task, a hook of the job's script).

Shorter: the site's requests time out and are asked again once the link is back, the job
completes and the model is exact. Longer: the server counts the site dead after its heartbeat
timeout and the job, which needs both sites, ends naming it (the link comes back only after). Either way no download folder, temp
file or process is left. Needs root and ``ip netns``; skipped where they are missing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from tests.faults.conftest import first_after
from tests.integration.runtime.conftest import processes_mentioning, read_json
from tests.integration.runtime.jobkit import expected_delta, make_bench_job

SERVER_ADDRESS, CLIENT_ADDRESS = "10.213.7.1", "10.213.7.2"  # inside the test's own namespaces only
HEARTBEAT_TIMEOUT_S = 3.0  # FAST_CELL of the bench job
STARTUP_S = 60.0

#: Each run builds network namespaces and waits out real timeouts: in the slow set.
pytestmark = pytest.mark.slow


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class CutNetwork:
    """Two network namespaces joined by a veth pair: the server's side and a client's side."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.server_ns, self.client_ns = f"fls{tag}", f"flc{tag}"
        self.server_link, self.client_link = f"vs{tag}", f"vc{tag}"
        _ip("netns", "add", self.server_ns)
        _ip("netns", "add", self.client_ns)
        _ip("link", "add", self.server_link, "netns", self.server_ns, "type", "veth",
            "peer", "name", self.client_link, "netns", self.client_ns)  # fmt: skip
        for ns, link, address in (
            (self.server_ns, self.server_link, SERVER_ADDRESS),
            (self.client_ns, self.client_link, CLIENT_ADDRESS),
        ):
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", link, "up")

    def cut(self) -> None:
        """Take the client's link down: its packets go nowhere, nobody is told."""
        _ip("-n", self.client_ns, "link", "set", self.client_link, "down")

    def restore(self) -> None:
        _ip("-n", self.client_ns, "link", "set", self.client_link, "up")

    def close(self) -> None:
        for ns in (self.server_ns, self.client_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _namespaces_work() -> str:
    """Why network namespaces cannot be used here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    try:
        CutNetwork().close()
    except (subprocess.SubprocessError, OSError) as e:
        return f"ip netns / veth pairs do not work here: {e}"
    return ""


@pytest.fixture
def network() -> Iterator[CutNetwork]:
    why = _namespaces_work()
    if why:
        pytest.skip(why)
    net = CutNetwork()
    yield net
    net.close()


class Job:
    """The server and two client processes of one job, each in its namespace; ended when the test ends."""

    def __init__(self, root: Path, job: Path, network: CutNetwork) -> None:
        self.root, self.job, self.network = root, job, network
        self.workspace = root / "workspace"
        self.processes: dict[str, subprocess.Popen[str]] = {}

    def start(self) -> None:
        clients = ["--clients", "site-1,site-2"]
        self.processes["server"] = self._start(self.network.server_ns, "server", "server", *clients,
                                               "--host", SERVER_ADDRESS, "--port", "0")  # fmt: skip
        endpoint = self._endpoint()
        for site, ns in (("site-1", self.network.server_ns), ("site-2", self.network.client_ns)):
            self.processes[site] = self._start(ns, "client", site, *clients, "--connect", endpoint)

    def _start(self, ns: str, role: str, site: str, *extra: str) -> subprocess.Popen[str]:
        folder = self.workspace / site
        folder.mkdir(parents=True, exist_ok=True)
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "engine.runtime.entry", role, "--site", site,
                   "--job", str(self.job), "--workspace", str(self.workspace), "--job-id", "job", "--insecure",
                   "--parent-pid", str(os.getpid()), *extra]  # fmt: skip
        output = subprocess.PIPE if role == "server" else subprocess.DEVNULL
        with open(folder / "stderr.txt", "w") as errors:
            return subprocess.Popen(command, cwd=folder, stdout=output, stderr=errors, text=True)

    def _endpoint(self) -> str:
        server = self.processes["server"]
        assert server.stdout is not None
        deadline = time.monotonic() + STARTUP_S
        for line in server.stdout:
            event = json.loads(line)
            if event.get("event") == "listening":
                return str(event["endpoint"])
            assert time.monotonic() < deadline, "the server never reported its endpoint"
        errors = (self.workspace / "server" / "stderr.txt").read_text()[-2000:]
        raise AssertionError(f"the server exited with {server.wait()} before it listened: {errors}")

    def wait_event(self, name: str, site: str, timeout_s: float = 30.0) -> None:
        """Wait until the server's events name ``site`` in an event ``name`` (its events file, polled)."""
        events = self.workspace / "server" / "events.jsonl"
        deadline = time.monotonic() + timeout_s
        while True:
            lines = events.read_text().splitlines() if events.exists() else []
            if any(f'"event": "{name}"' in line and f'"site": "{site}"' in line for line in lines):
                return
            assert time.monotonic() < deadline, f"no {name} event for {site}"
            time.sleep(0.01)

    def wait_paused(self, site: str) -> Path:
        """Wait until ``site``'s script is about to pull its task (the bench script's ``pause`` hook)."""
        custom = self.job / "app" / "custom"
        deadline = time.monotonic() + STARTUP_S
        while not (custom / f".paused-{site}").exists():
            assert time.monotonic() < deadline, f"{site} never reached its pause"
            assert self.processes["server"].poll() is None, "the server ended first"
            time.sleep(0.01)
        return custom / f".go-{site}"

    def finish(self, timeout_s: float = 60.0, then: Callable[[], None] = lambda: None) -> int:
        """Wait for the server, call ``then``, end the clients (as the simulator's launcher does); return its code."""
        server = self.processes["server"]
        try:
            server.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
        then()
        for site in ("site-1", "site-2"):
            process = self.processes[site]
            try:
                process.wait(timeout=3)
            except subprocess.TimeoutExpired:  # still asking for a server that is gone
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        return server.returncode

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


@pytest.fixture
def job_processes(tmp_path: Path, network: CutNetwork) -> Iterator[callable]:
    opened: list[Job] = []

    def start(job: Path) -> Job:
        running = Job(tmp_path, job, network)
        opened.append(running)
        running.start()
        return running

    yield start
    for running in opened:
        running.close()
    assert processes_mentioning(str(tmp_path)) == []


def _initial(job: Path, width: int) -> dict[str, torch.Tensor]:
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        return {name: t.detach().clone() for name, t in BenchNet(layers=2, width=width).state_dict().items()}


def _leftovers(workspace: Path) -> list[str]:
    """Download folders and temp files left in the workspace."""
    found = [p for p in workspace.rglob("*") if p.name.startswith("xfer-") or p.suffix in (".tmp", ".part")]
    return [str(p) for p in found]


def _bench_job(tmp_path: Path, width: int, cut_round: int, **workflow: object) -> Path:
    # Requests of 0.5 s, asked again after 0.2, 0.4, 0.8, 1.6 and 3.2 s: a cut of a second
    # loses chunk requests; a heartbeat timeout (3 s) ends it.
    streaming = "streaming_per_request_timeout = 0.5\nstreaming_retries = 5\nstreaming_retry_backoff_s = 0.2\n"
    return make_bench_job(
        tmp_path,
        num_rounds=3,
        width=width,
        chunk_bytes=4096,
        script_args=f"--fault pause --fault-site site-2 --fault-round {cut_round}",
        workflow_args=workflow,
        server_extra=streaming,
        client_extra=streaming,
    )


def test_a_cut_shorter_than_the_heartbeat_timeout_loses_nothing_and_the_model_is_exact(
    tmp_path: Path, network: CutNetwork, job_processes, fault_figures
) -> None:
    width = 64
    job = _bench_job(tmp_path, width, cut_round=0)  # its first task: nothing else of it is on the wire then
    initial = _initial(job, width)
    running = job_processes(job)

    go = running.wait_paused("site-2")  # its script waits: the task's tensors are pulled 0.25 s after it came
    running.wait_event("task_sent", "site-2")
    network.cut()  # site-2 pulls its round-1 model into a link that is down
    cut_at = time.time()
    time.sleep(1.2)  # shorter than the heartbeat timeout (3 s), longer than a chunk request (0.5 s)
    network.restore()
    go.touch()
    code = running.finish()

    workspace = running.workspace
    result = read_json(workspace / "server" / "result.json")
    assert (code, result["state"]) == (0, "FINISHED_COMPLETED"), result
    events = [json.loads(line) for line in (workspace / "server" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("event") == "client_dead"]
    assert [e["round"] for e in events if e.get("event") == "round_done"] == [1, 2, 3]
    site_log = (workspace / "site-2" / "log.txt").read_text()
    assert "asking again" in site_log  # the cut did cost requests, asked again once the link was back
    final = load_file(workspace / "server" / "models" / "global.safetensors")
    delta = 3 * expected_delta(2)
    for name, tensor in initial.items():
        assert torch.allclose(final[name].double(), tensor.double() + delta, rtol=0, atol=1e-6), name
    assert _leftovers(workspace) == []
    fault_figures.record(
        "a client's network link down for 1.2 s mid-download (heartbeat timeout 3 s; network namespaces)",
        "the lost requests are asked again once the link is back (`streaming_retries`); no site dead; "
        "FINISHED_COMPLETED",
        recover_s=first_after(events, "round_done", cut_at)["at"] - cut_at,
        rounds_lost=0,
        exact=True,
    )


def test_a_cut_longer_than_the_heartbeat_timeout_makes_the_site_dead_and_the_job_ends_naming_it(
    tmp_path: Path, network: CutNetwork, job_processes, fault_figures
) -> None:
    job = _bench_job(tmp_path, 16, cut_round=0, site_wait_timeout=1.0)
    running = job_processes(job)

    go = running.wait_paused("site-2")
    running.wait_event("task_sent", "site-2")
    network.cut()
    running.wait_event("client_dead", "site-2")

    def back_again() -> None:  # the link comes back after the job ended without site-2
        network.restore()
        go.touch()

    code = running.finish(then=back_again)

    workspace = running.workspace
    result = read_json(workspace / "server" / "result.json")
    assert result["state"] == "FINISHED_EXECUTION_EXCEPTION", result
    assert "1 of 2 sites alive, 2 needed (min_clients)" in result["reason"]
    assert f"dead: site-2 (no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s)" in result["reason"]
    assert code == 1  # the server process of a job that failed
    events = [json.loads(line) for line in (workspace / "server" / "events.jsonl").read_text().splitlines()]
    (death,) = [e for e in events if e.get("event") == "client_dead"]
    assert death["reason"] == f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s"
    assert _leftovers(workspace) == []
    fault_figures.record(
        "a client's network link down for good mid-download (2 sites, min_clients 2; network namespaces)",
        "the site is dead after the heartbeat timeout (3 s); the round waits site_wait_timeout (1 s here), then "
        "FINISHED_EXECUTION_EXCEPTION naming the site and why",
    )
