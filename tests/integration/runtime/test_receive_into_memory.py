"""A client holds one model: measured from outside, each process's peak RSS while a 256 MiB job runs.

The job is tools/bench.py's (BenchNet, FedAvg, one client, 3 rounds) with its module client
(``flare.receive(into=net)``), run by ``flengine run``; a thread samples ``/proc/<pid>/statm`` of
every process of the run every 50 ms. In ``in_process`` mode the client job process runs the
script: it holds the network, nothing else. In ``subprocess`` mode the script holds the network
and the client job process relays (pulls the task from the server, serves it to the script, pulls
the result from the script, serves it to the server): it lets go of the task's tensors before
the result arrives, so it too holds at most one model. Each is compared with the same process
type's size without a model (torch imported, cells up: the ``baseline`` below is generous).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

import bench  # noqa: E402
from proc_tree import process_tree, rss_mb  # noqa: E402

SIZE_MB = 256
MODEL_GB = SIZE_MB * 2**20 / 1e9
#: RSS of a client process without a model (Python, torch, cells, threads), and its slack.
BASELINE_GB = 0.45


def _peaks_by_process(root_pid: int, stop: threading.Event, peaks: dict[int, tuple[str, float]]) -> None:
    while not stop.is_set():
        for pid, (_, cmdline) in process_tree(root_pid).items():
            rss_gb = rss_mb(pid) * bench.MIB / 1e9
            if rss_gb > peaks.get(pid, ("", 0.0))[1]:
                peaks[pid] = (cmdline, rss_gb)
        time.sleep(bench.SAMPLE_INTERVAL_S)


@pytest.mark.slow
@pytest.mark.parametrize("execution_mode", ["in_process", "subprocess"])
def test_each_client_process_peaks_at_one_model(tmp_path: Path, execution_mode: str) -> None:
    point = bench.Point(SIZE_MB, 1, False, 2.0, rounds=3, client_script="module", execution_mode=execution_mode)
    job = bench.write_job(tmp_path / "job", point)
    command = [sys.executable, "-m", "engine", "run", str(job), "--workspace", str(tmp_path / "ws")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, tuple[str, float]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_peaks_by_process, args=(process.pid, stop, peaks))
    sampler.start()
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        stop.set()
        sampler.join()

    assert process.returncode == 0, output
    correct, worst = bench.check_model(tmp_path / "ws" / "server" / "models" / "global.safetensors", point)
    assert correct, worst
    client = [gb for cmdline, gb in peaks.values() if "--site site-1" in cmdline]
    script = [gb for cmdline, gb in peaks.values() if "train_module.py" in cmdline]
    assert len(client) == 1 and len(script) == (1 if execution_mode == "subprocess" else 0), peaks
    for gb in client + script:
        assert gb <= MODEL_GB + BASELINE_GB, f"a client process peaked at {gb:.2f} GB: more than one model"
