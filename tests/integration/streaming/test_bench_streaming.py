"""tools/bench_streaming.py at a small size: flengine and the raw pyzmq baseline, side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.fobs.page_strategy import choose_page_strategy, machine_facts

TOOLS = Path(__file__).resolve().parents[3] / "tools"
sys.path.insert(0, str(TOOLS))

from bench_streaming_raw import chunk_plan  # noqa: E402


@pytest.mark.parametrize(
    ("sizes", "chunk_bytes"),
    [([5, 3, 8], 4), ([5, 0, 3], 3), ([7], 16), ([4, 4], 0), ([1, 2, 3], 1)],
    ids=["spans", "empty-tensor", "one-short-chunk", "inline", "byte-chunks"],
)
def test_the_raw_chunks_cut_the_tensors_bytes_laid_end_to_end(sizes: list[int], chunk_bytes: int) -> None:
    stream = [(k, offset) for k, size in enumerate(sizes) for offset in range(size)]  # every byte, in order

    plan = chunk_plan(sizes, chunk_bytes)

    carried = [(k, offset) for chunk in plan for k, begin, end in chunk for offset in range(begin, end)]
    assert carried == stream
    step = chunk_bytes or sum(sizes)
    assert [sum(end - begin for _, begin, end in chunk) for chunk in plan] == [
        min(step, sum(sizes) - start) for start in range(0, sum(sizes), step)
    ]
    assert all(end > begin for chunk in plan for _, begin, end in chunk)


@pytest.mark.slow  # end to end and long; CI runs it with -m slow
def test_a_quick_run_compares_flengine_with_raw_pyzmq_of_the_same_run(tmp_path: Path) -> None:
    out = tmp_path / "streaming.json"

    done = subprocess.run(
        [sys.executable, str(TOOLS / "bench_streaming.py"), "--quick", "--size-mb", "16", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    raw = run["raw"]
    assert (run["chunk_bytes"], run["receivers"], run["security"], raw["security"]) == (2 << 20, 1, "curve", "curve")
    assert run["mismatched_tensors"] == raw["mismatched_tensors"] == 0
    for figures in (run, raw):
        assert figures["throughput_gib_s"] > 0 and figures["warm_throughput_gib_s"] > 0
        assert figures["cold_cpu_seconds"][0] > 0 and figures["cold_page_faults"][0] >= 0
    bytes_moved = (2048 * 2048 + 2048) * 4 / 2**30  # BenchNet of 16 MiB: one layer, in GiB
    assert raw["throughput_gib_s"] == pytest.approx(bytes_moved / raw["seconds"][0], rel=0.02)
    assert run["cold_ratio"] == pytest.approx(run["throughput_gib_s"] / raw["throughput_gib_s"], abs=0.002)
    assert run["warm_ratio"] == pytest.approx(run["warm_throughput_gib_s"] / raw["warm_throughput_gib_s"], abs=0.002)
    (case,) = result["summary"]
    assert case["cold_ratio_median"] == run["cold_ratio"] and case["repetitions"] == 1
    assert result["machine"]["page_strategy"] == choose_page_strategy(machine_facts()).name
    assert "raw cold" in done.stdout and "ratio" in done.stdout
