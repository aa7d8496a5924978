"""tools/bench_link.py on a small model behind a 200 Mbit/s link: the job runs in its namespaces at
the speed of the link, the bytes that cross the server's link are the models' bytes, and no
namespace is left. Needs root and network namespaces; real daemons, real links (about 40 s)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.runtime.conftest import processes_mentioning

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_link.py"
SIZE_MB, CLIENTS, RATE_MBIT, ROUNDS = 16, 2, 200, 3
#: BenchNet(16 MiB): one layer, 2048 x 2048 + 2048 float32.
MODEL_BYTES = (2048 * 2048 + 2048) * 4


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


@pytest.fixture
def netns_available() -> None:
    if os.geteuid() != 0:
        pytest.skip("bench_link.py makes network namespaces: needs root")
    probe = f"flb-probe-{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        pytest.skip("no `ip` command (iproute2)")
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], check=False)


def _has_quantize() -> bool:
    return importlib.util.find_spec("engine.filters.quantize") is not None


#: (quantize, rate in Mbit/s, the server link's bytes per round as a share of the fp32 models'):
#: int8 sends about a quarter of the bytes, at half the rate to keep the link the bottleneck.
CASES = [
    pytest.param(None, 200, (0.97, 1.15), id="fp32"),
    pytest.param(
        "int8", 100, (0.24, 0.30), id="int8",
        marks=pytest.mark.skipif(not _has_quantize(), reason="engine.filters.quantize is not there yet"),
    ),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.usefixtures("netns_available")
@pytest.mark.parametrize(("quantize", "rate_mbit", "share"), CASES)
def test_a_job_behind_a_slow_link_runs_at_its_speed_and_leaves_no_namespace(
    tmp_path: Path, quantize: str | None, rate_mbit: int, share: tuple[float, float]
) -> None:
    out = tmp_path / "link.json"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    command = [sys.executable, str(TOOL), "--size-mb", str(SIZE_MB), "--clients", str(CLIENTS)]
    command += ["--rate-mbit", str(rate_mbit), "--rounds", str(ROUNDS), "--out", str(out)]
    command += ["--quantize", quantize] if quantize else []

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()

    assert process.returncode == 0, stderr
    document = json.loads(out.read_text())
    assert (document["status"], document["correct"]) == ("FINISHED_COMPLETED", True), document
    if quantize is None:
        assert document["max_abs_error"] <= 1e-6
    else:
        assert 0 < document["max_error_of_tolerance"] <= 1.0
    assert len(document["round_s"]) == ROUNDS
    assert document["model_bytes"] == MODEL_BYTES
    # Every round the server sends the model to each client and gets one back, nothing else of size.
    payload = 2 * CLIENTS * MODEL_BYTES
    assert share[0] * payload <= document["server_link_bytes"] <= share[1] * payload, document
    assert document["link_bound_s"] == pytest.approx(document["server_link_bytes"] * 8 / (rate_mbit * 1e6), rel=1e-3)
    # The shaping holds the rounds to the link's pace, and the job adds little on top of it.
    assert document["steady_round_s"] >= 0.9 * document["link_bound_s"], document
    assert document["steady_round_s"] <= 4.0 * document["link_bound_s"], document
    assert document["ratio"] == pytest.approx(document["steady_round_s"] / document["link_bound_s"], rel=1e-2)
    assert "FINISHED_COMPLETED" in stdout and "model ok" in stdout
    # Its namespaces (named after its pid) are gone, and so are its processes and folders.
    namespaces = document["topology"]["namespaces"]
    assert namespaces and all(name.startswith(f"flb-{process.pid}-") for name in namespaces)
    assert [name for name in _namespaces() if name.startswith(f"flb-{process.pid}-")] == []
    assert processes_mentioning(str(tmp_path / "tmp")) == []
    assert list((tmp_path / "tmp").glob("flengine-bench-link-*")) == []
