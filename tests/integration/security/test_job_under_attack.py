"""A real job (server and client processes, CURVE keys) while attackers try their luck, and the
clear errors a site with bad keys gets at start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from safetensors.torch import load_file

from engine.cells.envelope import Envelope, encode_envelope
from engine.cells.protocol import Kind
from engine.config import job_code_on_path
from engine.runtime import protocol
from engine.security import write_key_pair, write_public_key
from engine.site import SiteEndpoint, SiteSettings
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import expected_delta, make_bench_job
from tests.integration.runtime.test_server_process import FAST, SITES, finish, start_process, wait_endpoint

REFUSAL_S = 3.0


@pytest.fixture(autouse=True)
def _no_process_left(no_leftovers: None) -> None:
    """Every test here starts real processes: none may outlive it."""


def attack(address: str, keys: dict[str, Path], tmp_path: Path) -> dict[str, object]:
    """Try each way in that a stranger or a lying site has; return what each one got."""
    outcome: dict[str, object] = {}
    context = zmq.Context()
    try:  # a plain socket that speaks the cells protocol
        sock = context.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(address)
        sock.send(encode_envelope(Envelope(Kind.HELLO, 1, "site-2", "")))
        outcome["plain"] = sock.poll(int(REFUSAL_S * 1000))
    finally:
        context.destroy(linger=0)
    stranger = tmp_path / "stranger"
    write_key_pair(stranger, "site-3")
    (stranger / "server.key").write_bytes((keys["site-1"] / "server.key").read_bytes())
    opened = []
    try:
        for label, site, folder, name in [
            ("unknown_key", "site-3", stranger, None),
            ("site-1_as_site-2", "site-1", keys["site-1"], "site-2"),
            ("site-1_as_server", "site-1", keys["site-1"], "server"),
        ]:
            endpoint = SiteEndpoint.for_site(SiteSettings(site, FAST, folder), {}, connect_to=address, cell_name=name)
            opened.append(endpoint.start())
            outcome[label] = endpoint.cell.wait_connected(REFUSAL_S)
        # site-1's child cell is let in, but the job does not know it: it gets no task.
        child = SiteEndpoint.for_site(SiteSettings("site-1", FAST, keys["site-1"]), {}, connect_to=address,
                                      cell_name="site-1.evil").start()  # fmt: skip
        opened.append(child)
        assert child.cell.wait_connected(10.0)
        reply = child.cell.request_async("server", protocol.TASK_CHANNEL, protocol.TOPIC_GET_TASK).result(10.0)
        outcome["child_task"] = "refused" if "not a client of this job" in reply.reason else reply.header
    finally:
        for endpoint in opened:
            endpoint.close()
    return outcome


def test_the_job_finishes_exact_while_strangers_and_impostors_try(tmp_path: Path, keys: dict[str, Path]) -> None:
    job = make_bench_job(tmp_path, num_rounds=2, layers=1, width=8)
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        initial = {name: t.detach().clone() for name, t in BenchNet(layers=1, width=8).state_dict().items()}
    workspace = tmp_path / "workspace"
    server = start_process("server", job, workspace, keys, "--clients", ",".join(SITES))
    clients = []
    try:
        address = wait_endpoint(server)
        outcome = attack(address, keys, tmp_path)  # while the job waits for its clients
        clients = [start_process("client", job, workspace, keys, "--connect", address, site=site) for site in SITES]
        codes = [finish(process) for process in (server, *clients)]
    finally:
        for process in (server, *clients):
            if process.poll() is None:
                process.kill()
                finish(process)

    assert outcome == {
        "plain": 0,
        "unknown_key": False,
        "site-1_as_site-2": False,
        "site-1_as_server": False,
        "child_task": "refused",
    }
    assert codes == [0, 0, 0]
    assert read_json(workspace / "server" / "result.json")["state"] == "FINISHED_COMPLETED"
    final = load_file(workspace / "server" / "models" / "global.safetensors")
    assert set(final) == set(initial)
    for name, tensor in initial.items():  # two rounds of the two honest sites, nothing else
        assert torch.allclose(final[name].double(), tensor.double() + 2 * expected_delta(2), rtol=0, atol=1e-6), name
    server_log = (workspace / "server" / "log.txt").read_text(encoding="utf-8")
    assert "key not on the allowlist" in server_log and "which may not send as 'site-2'" in server_log


def test_a_client_given_the_wrong_server_key_stops_at_once_naming_the_file(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, layers=1, width=8)
    workspace = tmp_path / "workspace"
    wrong = keys["site-1"] / "server.key"
    wrong.unlink()
    other_public, _ = zmq.curve_keypair()
    write_public_key(wrong, "server", other_public)
    server = start_process("server", job, workspace, keys, "--clients", "site-1")
    try:
        address = wait_endpoint(server)
        started = time.monotonic()
        client = start_process("client", job, workspace, keys, "--connect", address, site="site-1")
        client.stdout.close()
        code = client.wait(timeout=60)
        seconds = time.monotonic() - started
    finally:
        server.terminate()
        finish(server)

    stderr = (workspace / "site-1" / "log.txt").read_text(encoding="utf-8")
    assert code == 1
    assert seconds < 30, "a refused client must not wait out the server-silence limit"
    assert f"check that {wrong} is the server's public key" in stderr


def test_a_secret_key_readable_by_others_stops_the_site_at_start(tmp_path: Path, keys: dict[str, Path]) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, layers=1, width=8)
    secret = keys["server"] / "server.key_secret"
    os.chmod(secret, 0o644)

    result = subprocess.run(
        [sys.executable, "-m", "engine.runtime.entry", "server", "--job", str(job), "--workspace",
         str(tmp_path / "workspace"), "--keys", str(keys["server"]), "--clients", "site-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip

    assert result.returncode == 1
    assert f"Error: server: {secret}: the secret key file may be read by others (mode 0644)" in result.stderr
    assert f"run `chmod 600 {secret}`" in result.stderr
