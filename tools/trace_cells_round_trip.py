"""Where a cells round trip spends its time: a timeline of one request and its reply, both processes.

The parent runs a client cell, a child process the server cell answering ``bench/ping`` with an
empty reply (its handler on the pool, or with ``--inline`` on the I/O thread), as
``tools/bench_cells.py`` does. Both processes stamp the monotonic clock (one clock for every
process of the host) at each step a message takes through the cells layer: the caller's request,
the outbox, each I/O thread's ``zmq.Poller.poll`` and sends and receives, the handler pool, the
reply's future. The steps are found by wrapping the layer's own functions, so the figures include
a few microseconds of stamping each.

Each round trip gives a sequence of stamps; the most common sequence is kept, and the median time
between each two steps of it is printed, then the median round trip. Requests are spaced by
``--gap-us`` so that every thread sleeps between them, as a site asking for a task does.

Usage::

    python tools/trace_cells_round_trip.py [--inline] [--curve] [--count N] [--out FILE]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cells import cell as cell_module  # noqa: E402 - after the path is set
from engine.cells import core, io_thread, outbox, pending, pool  # noqa: E402
from tools.bench_cells import KEYS_ENV, cell_security, keys_from_environment, make_keys  # noqa: E402 - one home

STAMPS_ENV = "TRACE_CELLS_STAMPS"  # where the child writes its stamps
stamps: list[tuple[str, int]] = []


def stamp_calls(owner: Any, name: str, step: str, after: bool = False) -> None:
    """Stamp ``step`` when ``owner.name`` is called (``after``: when it returns)."""
    original = getattr(owner, name)
    clock = time.monotonic_ns

    def stamped(*args: Any, **kwargs: Any) -> Any:
        if not after:
            stamps.append((step, clock()))
        returned = original(*args, **kwargs)
        if after:
            stamps.append((step, clock()))
        return returned

    setattr(owner, name, stamped)


def stamp_the_layer() -> None:
    stamp_calls(outbox.Outbox, "put", "outbox put")
    stamp_calls(zmq.Poller, "poll", "poll: sleeps")
    stamp_calls(zmq.Poller, "poll", "poll: wakes", after=True)
    stamp_calls(io_thread.IoThread, "_receive", "receive")
    stamp_calls(core.CellCore, "on_frames", "frames to the core")
    stamp_calls(pool.HandlerPool, "submit", "to the pool")
    stamp_calls(cell_module, "run_handler", "handler runs")
    stamp_calls(io_thread.IoThread, "_send", "zmq send")
    stamp_calls(io_thread.IoThread, "_send", "zmq sent", after=True)
    stamp_calls(pending.PendingRequests, "resolve", "reply resolved")


def serve(inline: bool) -> None:
    """Child process: the server cell; writes its stamps when stdin closes."""
    from engine.cells import Cell, CellSettings

    stamp_the_layer()
    security = cell_security(keys_from_environment(), server=True)
    cell = Cell("server", CellSettings(port=0, handler_pool_size=4), security=security)
    cell.register_handler("bench", "ping", lambda message: None, inline=inline)
    with cell:
        print(cell.endpoint, flush=True)
        sys.stdin.read()
    Path(os.environ[STAMPS_ENV]).write_text(json.dumps(stamps))


def timeline(
    calls: list[tuple[int, int]], client: list[tuple[str, int]], server: list[tuple[str, int]]
) -> tuple[list[tuple[str, str, float]], int]:
    """The most common sequence of steps within a call, with the median time of each; how many calls had it."""
    events = sorted(
        [(f"client: {s}", t) for s, t in client] + [(f"server: {s}", t) for s, t in server], key=lambda e: e[1]
    )
    times = [t for _, t in events]
    sequences: collections.Counter[tuple[str, ...]] = collections.Counter()
    gaps: dict[tuple[tuple[str, ...], int], list[float]] = collections.defaultdict(list)
    for start, end in calls:
        inside = [
            ("client: request", start),
            *events[bisect.bisect_left(times, start) : bisect.bisect_right(times, end)],
        ]
        inside.append(("client: returns", end))
        steps = tuple(step for step, _ in inside)
        sequences[steps] += 1
        for index, ((_, t1), (_, t2)) in enumerate(zip(inside, inside[1:], strict=False)):
            gaps[(steps, index)].append((t2 - t1) / 1000)
    steps, count = sequences.most_common(1)[0]
    return [(steps[i], steps[i + 1], statistics.median(gaps[(steps, i)])) for i in range(len(steps) - 1)], count


def trace(inline: bool, curve: bool, count: int, gap_us: float) -> dict:
    from engine.cells import Cell, CellSettings

    handle, stamps_file = tempfile.mkstemp(prefix="trace-cells-", suffix=".json")
    os.close(handle)
    env = dict(os.environ, **{STAMPS_ENV: stamps_file})
    env.pop(KEYS_ENV, None)
    keys = None
    if curve:
        key_text = make_keys()
        env[KEYS_ENV] = json.dumps(key_text)
        keys = {name: value.encode() for name, value in key_text.items()}
    command = [sys.executable, os.path.abspath(__file__), "--serve", *(["--inline"] * inline)]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        endpoint = child.stdout.readline().strip()
        stamp_the_layer()
        cell = Cell("site-1", CellSettings(), connect_to=endpoint, security=cell_security(keys, server=False)).start()
        try:
            if not cell.wait_connected(30):
                raise RuntimeError(f"client cell did not register with {endpoint}")
            for _ in range(200):
                cell.request("server", "bench", "ping", timeout_s=30)
            stamps.clear()
            calls = []
            for _ in range(count):
                start = time.monotonic_ns()
                cell.request("server", "bench", "ping", timeout_s=30)
                calls.append((start, time.monotonic_ns()))
                time.sleep(gap_us / 1e6)
        finally:
            cell.stop()
        child.stdin.close()
        child.wait(timeout=30)
        server_stamps = [tuple(entry) for entry in json.loads(Path(stamps_file).read_text())]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        Path(stamps_file).unlink(missing_ok=True)
    steps, matching = timeline(calls, list(stamps), server_stamps)
    return {
        "handler": "inline" if inline else "pool",
        "security": "curve" if curve else "none",
        "calls": count,
        "calls_with_this_sequence": matching,
        "steps_us": [{"from": a, "to": b, "median_us": round(us, 1)} for a, b, us in steps],
        "round_trip_p50_us": round(statistics.median((end - start) / 1000 for start, end in calls), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inline", action="store_true", help="the server's handler runs on its I/O thread")
    parser.add_argument("--curve", action="store_true", help="CURVE, as a job's cells (default: plain TCP)")
    parser.add_argument("--count", type=int, default=3000, help="round trips traced (default 3000)")
    parser.add_argument("--gap-us", type=float, default=200.0, help="pause between two requests (default 200 µs)")
    parser.add_argument("--out", help="write the JSON result to this file")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.inline)
        return 0
    result = trace(args.inline, args.curve, args.count, args.gap_us)
    print(
        f"{result['handler']} handler, {result['security']} security; "
        f"{result['calls_with_this_sequence']} of {result['calls']} calls took these steps:"
    )
    for step in result["steps_us"]:
        print(f"  {step['from']:>26} -> {step['to']:<26} {step['median_us']:7.1f} µs")
    print(f"round trip p50: {result['round_trip_p50_us']} µs")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
