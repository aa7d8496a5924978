"""tools/bench_fold.py and tools/bench_cells.py at small sizes: the figures they give rest on a
fold that makes the right mean and on a pull spread over several connections that gets every frame."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _run(tool: str, *args: str) -> None:
    subprocess.run([sys.executable, str(TOOLS / tool), *args], check=True, capture_output=True, timeout=120)


def test_the_fold_benchmark_checks_the_mean_of_results_folded_by_two_threads(tmp_path: Path) -> None:
    out = tmp_path / "fold.json"

    # The tool raises (and exits non-zero) when a mean differs from its closed form.
    _run("bench_fold.py", "--size-mb", "8", "--results", "4", "--threads", "1", "2", "--chunk-mb", "0.75",
         "--check", "one-pass", "raw", "--repeats", "1", "--out", str(out))  # fmt: skip

    runs = json.loads(out.read_text())["runs"]
    assert [(run["check"], run["threads"]) for run in runs] == [
        ("one-pass", 1), ("one-pass", 2), ("raw", 1), ("raw", 2)
    ]  # fmt: skip
    assert all(run["median_s"] > 0 for run in runs)


def test_a_raw_pull_spread_over_two_curve_connections_gets_every_frame(tmp_path: Path) -> None:
    out = tmp_path / "cells.json"

    _run("bench_cells.py", "--raw", "--connections", "2", "--repeat", "1", "--total-mib", "32",
         "--rtt-count", "20", "--out", str(out))  # fmt: skip

    result = json.loads(out.read_text())
    assert result["connections"] == 2 and result["security"] == "curve"
    assert set(result["throughput_gib_s"]) == {f"{s}MiBx{n}" for s in (2, 8) for n in (1, 4, 8)}
    assert all(value > 0 for value in result["throughput_gib_s"].values())


def test_the_round_trip_trace_follows_a_request_through_the_handler_pool_and_back(tmp_path: Path) -> None:
    """tools/trace_cells_round_trip.py stamps the cells layer's own functions: a step renamed away
    would drop out of the timeline, and this test with it."""
    out = tmp_path / "trace.json"

    _run("trace_cells_round_trip.py", "--curve", "--count", "200", "--gap-us", "0", "--out", str(out))

    result = json.loads(out.read_text())
    steps = [step["from"] for step in result["steps_us"]] + [result["steps_us"][-1]["to"]]
    for step in ("client: outbox put", "server: to the pool", "server: handler runs", "client: reply resolved"):
        assert step in steps
    assert steps[0] == "client: request" and steps[-1] == "client: returns"
    assert result["security"] == "curve" and result["calls_with_this_sequence"] > 0
    assert 0 < sum(step["median_us"] for step in result["steps_us"]) < 1e6
