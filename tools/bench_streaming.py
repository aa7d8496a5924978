"""Benchmark of tensor streaming: a BenchNet state dict from one process to N others, via FOBS.

    python tools/bench_streaming.py --size-mb 1024 [--transfers 2] [--repeat 3] [--insecure] [--out FILE]

For each chunk size (2 MiB, 8 MiB, 0 = inline) and receiver count (1, 4), a sender process
builds BenchNet (BENCHMARK.md) and serves it to every receiver ``--transfers`` times, each time
as one message serialized once for all receivers with the via-downloader decomposers, like the
global model of successive FL rounds. Each receiver process pulls it, rebuilds the state dict,
checks every tensor against BenchNet (regenerated one layer at a time) and drops it before the
next transfer. The first transfer of a process is "cold" (its memory is faulted in fresh); the
later ones are "warm" (the tensor pool hands out the memory of the dropped ones), as in rounds
2 and on of a job; for a cold one, the receiver also reports the seconds its page populator's
threads spent faulting in the new memory (``cold_fault_in_seconds``, summed over the threads),
what this machine charges for memory a process has not had before. Every process sets glibc's
allocator as flengine's job processes do. Peak RSS is the kernel's high-water mark (VmHWM) of
each process; ``baseline`` is a process's RSS after its imports, before any tensor exists.
Every connection is CURVE, as in a job (fresh key pairs, the sender's allowlist holding the
receivers' keys); ``--insecure`` measures plain TCP for the comparison.

Each case also runs the raw baseline (tools/bench_streaming_raw.py): the same state dict, chunk
size, requests in flight and security between plain pyzmq processes, the first transfer of each
receiver into tensors it has just made with ``torch.empty`` (cold), the later ones into the same
tensors (warm). Raw and flengine run in turn, ``--repeat`` times per case, so that each flengine
run has a raw run of the same minutes beside it: ``cold_ratio`` is flengine's cold throughput over
the raw one of the same repetition. Receivers also report the CPU seconds their process spent on
each transfer (all threads) and the page faults it took.

Prints a table and writes JSON:
``{"model_mb": N, "machine": {...}, "runs": [{"chunk_bytes", "receivers", "repetition",
"throughput_gib_s", "warm_throughput_gib_s", "sender_peak_rss_mb", "receiver_peak_rss_mb",
"raw": {"throughput_gib_s", "warm_throughput_gib_s", ...}, "cold_ratio", "warm_ratio", ...}, ...],
"summary": [{"chunk_bytes", "receivers", "cold_ratio_median", ...}, ...]}``.
``--quick`` runs one small case (64 MiB, 2 MiB chunks, one receiver) in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_streaming_raw  # noqa: E402
import benchnet  # noqa: E402
import zmq  # noqa: E402
from bench_streaming_raw import rss_mb, usage  # noqa: E402,F401 - one home for measuring a process

CHUNK_SIZES = (2 << 20, 8 << 20, 0)
RECEIVER_COUNTS = (1, 4)
TIMEOUT_S = 600.0
#: How the parent hands every process its CURVE keys (absent: plain TCP).
KEYS_ENV = "BENCH_STREAMING_CURVE_KEYS"


def make_keys(receivers: int) -> dict[str, list[str]]:
    """A key pair for the sender and one per receiver (Z85 text)."""
    pairs = {"server": zmq.curve_keypair()} | {f"site-{k}": zmq.curve_keypair() for k in range(1, receivers + 1)}
    return {name: [public.decode(), secret.decode()] for name, (public, secret) in pairs.items()}


def cell_security(name: str):  # noqa: ANN201 - a CellSecurity, or None when insecure
    from engine.cells.security import Allowlist, CellSecurity

    text = os.environ.get(KEYS_ENV)
    if not text:
        return None
    keys = {site: [part.encode() for part in pair] for site, pair in json.loads(text).items()}
    public, secret = keys[name]
    if name == "server":
        allowlist = Allowlist({site: pair[0] for site, pair in keys.items() if site != "server"})
        return CellSecurity(public, secret, allowlist=allowlist)
    return CellSecurity(public, secret, server_public_key=keys["server"][0])


def streaming_registry():  # noqa: ANN201 - imported lazily so the parent stays light
    from engine import fobs
    from engine.streaming.via_downloader import install_via_downloader

    registry = fobs.new_registry()
    install_via_downloader(registry)
    return registry


def run_sender(size_mb: float, chunk_bytes: int, receivers: int, transfers: int) -> None:
    from engine import fobs
    from engine.cells import Cell, CellSettings, Reply
    from engine.streaming.service import DownloadService
    from engine.streaming.via_downloader import RECEIVERS_PROP, STREAMING_PROP, StreamingContext

    baseline = rss_mb()
    tensors = benchnet.state_dict(size_mb)
    model_rss = rss_mb()
    cell = Cell("server", CellSettings(port=0, heartbeat_timeout_s=60.0), security=cell_security("server")).start()
    service = DownloadService(cell)
    context = StreamingContext(cell, service, chunk_bytes, chunk_bytes, TIMEOUT_S, TIMEOUT_S)
    sites = [f"site-{k}" for k in range(1, receivers + 1)]
    props = {STREAMING_PROP: context, RECEIVERS_PROP: sites}
    for transfer in range(transfers):
        header, frames = fobs.serialize(tensors, fobs.EncodeContext(props=props), streaming_registry())
        reply = Reply(frames=[header, *frames])
        cell.register_handler("bench", f"get-{transfer}", lambda message, reply=reply: reply)
    print(f"READY {cell.endpoint} {baseline:.1f} {model_rss:.1f}", flush=True)
    sys.stdin.read()
    print(f"PEAK {rss_mb('VmHWM'):.1f}", flush=True)
    service.close()
    cell.stop()


def run_receiver(endpoint: str, site: str, size_mb: float, transfers: int, in_flight: int) -> None:
    from engine import fobs
    from engine.cells import Cell, CellSettings
    from engine.fobs.page_populator import PAGE_POPULATOR
    from engine.streaming.via_downloader import STREAMING_PROP, StreamingContext

    registry = streaming_registry()
    baseline = rss_mb()
    security = cell_security(site)
    cell = Cell(site, CellSettings(heartbeat_timeout_s=60.0), connect_to=endpoint, security=security).start()
    cell.wait_connected(timeout_s=30)
    print("CONNECTED", flush=True)
    for transfer in range(transfers):
        sys.stdin.readline()  # GO
        populating_before = PAGE_POPULATOR.populate_seconds
        before = usage()
        start = time.perf_counter()
        reply = cell.request("server", "bench", f"get-{transfer}", timeout_s=TIMEOUT_S)
        streaming = StreamingContext(cell, per_request_timeout_s=TIMEOUT_S, max_in_flight=in_flight)
        context = fobs.DecodeContext(props={STREAMING_PROP: streaming})
        tensors = fobs.deserialize(reply.frames[0], reply.frames[1:], context, registry)
        del reply  # inline frames are no longer needed once the tensors are rebuilt
        seconds = time.perf_counter() - start
        PAGE_POPULATOR.wait_idle()  # a last madvise may still walk pages the transfer wrote
        populating = PAGE_POPULATOR.populate_seconds - populating_before
        cpu, faults = (after - was for after, was in zip(usage(), before, strict=True))
        peak = rss_mb("VmHWM")
        wrong = benchnet.mismatches(tensors, size_mb)
        del tensors
        fields = f"{seconds:.4f} {baseline:.1f} {peak:.1f} {len(wrong)} {populating:.4f} {cpu:.4f} {faults:.0f}"
        print(f"RESULT {fields}", flush=True)
    cell.stop()


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def expect(process: subprocess.Popen[str], word: str) -> list[str]:
    line = process.stdout.readline()
    if not line.startswith(word):
        raise RuntimeError(f"expected {word} from a benchmark process, got {line!r} (exit {process.poll()})")
    return line.split()[1:]


def run_case(
    size_mb: float,
    chunk_bytes: int,
    receivers: int,
    transfers: int,
    in_flight: int,
    insecure: bool = False,
    raw: bool = False,
) -> dict:
    """One case: a sender and ``receivers`` receivers, flengine's (or with ``raw`` plain pyzmq)."""
    env = dict(os.environ)
    env.pop(KEYS_ENV, None)
    if not insecure:
        env[KEYS_ENV] = json.dumps(make_keys(receivers))
    prefix = "raw-" if raw else ""
    sender = spawn("--role", f"{prefix}sender", "--size-mb", str(size_mb), "--chunk-bytes", str(chunk_bytes),
                   "--receivers", str(receivers), "--transfers", str(transfers), env=env)  # fmt: skip
    children = [sender]
    try:
        endpoint, sender_baseline, sender_model = expect(sender, "READY")
        readers = [spawn("--role", f"{prefix}receiver", "--endpoint", endpoint, "--site", f"site-{k}",
                         "--size-mb", str(size_mb), "--transfers", str(transfers), "--in-flight", str(in_flight),
                         "--chunk-bytes", str(chunk_bytes), env=env)
                   for k in range(1, receivers + 1)]  # fmt: skip
        children += readers
        for reader in readers:
            expect(reader, "CONNECTED")
        results = []  # per transfer, per reader
        for _ in range(transfers):
            for reader in readers:
                reader.stdin.write("GO\n")
                reader.stdin.flush()
            results.append([expect(reader, "RESULT") for reader in readers])
        sender.stdin.close()
        (sender_peak,) = expect(sender, "PEAK")
    finally:
        for child in children:
            if child.poll() is None and child.stdin and not child.stdin.closed:
                child.stdin.close()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    model_bytes = sum(t.numel() * 4 for t in benchnet.layer(0)) * benchnet.layer_count(size_mb)
    seconds = [float(r[0]) for r in results[0]]
    warm_seconds = [float(r[0]) for later in results[1:] for r in later]
    every = [r for transfer in results for r in transfer]
    return {
        "chunk_bytes": chunk_bytes,
        "receivers": receivers,
        "transfers": transfers,
        "in_flight": in_flight,
        "security": "none" if insecure else "curve",
        "throughput_gib_s": round(statistics.mean(model_bytes / s for s in seconds) / 2**30, 3),
        "throughput_gib_s_min": round(min(model_bytes / s for s in seconds) / 2**30, 3),
        "seconds": [round(s, 3) for s in seconds],
        "cold_fault_in_seconds": [round(float(r[4]), 3) for r in results[0]],
        "cold_cpu_seconds": [round(float(r[5]), 3) for r in results[0]],
        "cold_page_faults": [int(r[6]) for r in results[0]],
        "warm_throughput_gib_s": round(statistics.mean(model_bytes / s for s in warm_seconds) / 2**30, 3)
        if warm_seconds
        else None,
        "warm_seconds": [round(s, 3) for s in warm_seconds],
        "warm_cpu_seconds": [round(float(r[5]), 3) for later in results[1:] for r in later],
        "sender_peak_rss_mb": float(sender_peak),
        "sender_baseline_mb": float(sender_baseline),
        "sender_model_rss_mb": float(sender_model),
        "sender_extra_mb": round(float(sender_peak) - float(sender_model), 1),
        "receiver_peak_rss_mb": max(float(r[2]) for r in every),
        "receiver_baseline_mb": max(float(r[1]) for r in every),
        "mismatched_tensors": sum(int(r[3]) for r in every),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator and denominator else None


def compared_case(size_mb: float, chunk: int, receivers: int, args: argparse.Namespace, repetition: int) -> dict:
    """One repetition of a case: raw and flengine in turn (which first alternates), and their ratios."""
    order = (True, False) if repetition % 2 == 0 else (False, True)
    measured = {raw: run_case(size_mb, chunk, receivers, args.transfers, args.in_flight, args.insecure, raw)
                for raw in order}  # fmt: skip
    run, raw = measured[False], measured[True]
    run["repetition"] = repetition
    run["raw"] = {key: value for key, value in raw.items() if key not in ("chunk_bytes", "receivers", "transfers")}
    run["cold_ratio"] = ratio(run["throughput_gib_s"], raw["throughput_gib_s"])
    run["warm_ratio"] = ratio(run["warm_throughput_gib_s"], raw["warm_throughput_gib_s"])
    return run


def summarize(runs: list[dict]) -> list[dict]:
    """Per case: the median and the range over repetitions of flengine's, raw's and their ratio."""
    cases: dict[tuple[int, int], list[dict]] = {}
    for run in runs:
        cases.setdefault((run["chunk_bytes"], run["receivers"]), []).append(run)
    summary = []
    for (chunk, receivers), group in cases.items():
        figures = {
            "cold_gib_s": [run["throughput_gib_s"] for run in group],
            "raw_cold_gib_s": [run["raw"]["throughput_gib_s"] for run in group],
            "cold_ratio": [run["cold_ratio"] for run in group if run["cold_ratio"] is not None],
            "warm_gib_s": [run["warm_throughput_gib_s"] for run in group if run["warm_throughput_gib_s"]],
            "raw_warm_gib_s": [
                run["raw"]["warm_throughput_gib_s"] for run in group if run["raw"]["warm_throughput_gib_s"]
            ],
            "warm_ratio": [run["warm_ratio"] for run in group if run["warm_ratio"] is not None],
        }
        entry: dict = {"chunk_bytes": chunk, "receivers": receivers, "repetitions": len(group)}
        for name, values in figures.items():
            if values:
                entry[f"{name}_median"] = round(statistics.median(values), 3)
                entry[f"{name}_range"] = [min(values), max(values)]
        summary.append(entry)
    return summary


def machine() -> dict:
    """What the page strategy is chosen from, and what it chose, on this machine."""
    from dataclasses import asdict

    from engine.fobs.page_strategy import OVERRIDE_ENV, machine_facts, page_strategy_here

    strategy = page_strategy_here()  # what the receivers, started with this environment, chose
    return asdict(machine_facts()) | {
        "page_strategy": strategy.name,
        "page_strategy_reason": strategy.reason,
        "override": os.environ.get(OVERRIDE_ENV),
    }


def print_table(model_mb: float, runs: list[dict], summary: list[dict], insecure: bool, here: dict) -> None:
    security = "plain TCP (--insecure)" if insecure else "CURVE"
    print(f"BenchNet {model_mb} MiB, sender -> receivers over TCP loopback, {security} (peak RSS = VmHWM, MiB)")
    print(f"page strategy of flengine's receivers: {here['page_strategy']} ({here['page_strategy_reason']})")
    print("cold / min / warm: GiB/s per transfer; fault-in: CPU seconds the page populator spent on a cold one;")
    print("cpu: CPU seconds of a receiver process on a cold one; raw: plain pyzmq, same repetition; x: flengine / raw")
    widths = {"chunk": 7, "recv": 4, "rep": 3, "cold": 6, "min": 6, "fault-in": 8, "cpu": 5, "warm": 6}
    widths |= {"raw cold": 8, "raw cpu": 7, "raw warm": 8, "x cold": 6, "x warm": 6}
    widths |= {"send peak": 9, "send extra": 10, "recv peak": 9, "raw peak": 8, "recv base": 9, "bad": 3}
    print(" ".join(f"{name:>{width}}" for name, width in widths.items()))

    def figure(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for run in runs:
        raw = run["raw"]
        chunk = f"{run['chunk_bytes'] >> 20}MiB" if run["chunk_bytes"] else "inline"
        cells = [chunk, run["receivers"], run["repetition"], figure(run["throughput_gib_s"])]
        cells += [figure(run["throughput_gib_s_min"]), figure(statistics.mean(run["cold_fault_in_seconds"]))]
        cells += [figure(statistics.mean(run["cold_cpu_seconds"])), figure(run["warm_throughput_gib_s"])]
        cells += [figure(raw["throughput_gib_s"]), figure(statistics.mean(raw["cold_cpu_seconds"]))]
        cells += [figure(raw["warm_throughput_gib_s"]), figure(run["cold_ratio"]), figure(run["warm_ratio"])]
        cells += [f"{run[key]:.0f}" for key in ("sender_peak_rss_mb", "sender_extra_mb", "receiver_peak_rss_mb")]
        cells += [f"{raw['receiver_peak_rss_mb']:.0f}", f"{run['receiver_baseline_mb']:.0f}"]
        cells += [run["mismatched_tensors"] + raw["mismatched_tensors"]]
        print(" ".join(f"{cell!s:>{width}}" for cell, width in zip(cells, widths.values(), strict=True)))
    print("medians over repetitions (ranges in the JSON summary):")
    for case in summary:
        chunk = f"{case['chunk_bytes'] >> 20}MiB" if case["chunk_bytes"] else "inline"
        print(
            f"  {chunk:>6} x {case['receivers']}: cold {case['cold_gib_s_median']:.2f} GiB/s, "
            f"raw cold {case['raw_cold_gib_s_median']:.2f}, ratio {case.get('cold_ratio_median', 0):.2f} "
            f"({case.get('cold_ratio_range', ['-', '-'])[0]}-{case.get('cold_ratio_range', ['-', '-'])[1]}); "
            f"warm ratio {case.get('warm_ratio_median', 0):.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, help="BenchNet size in MiB (default 1024; 64 with --quick)")
    parser.add_argument(
        "--transfers", type=int, default=2, help="transfers per receiver process, the first cold (default 2)"
    )
    parser.add_argument(
        "--in-flight", type=int, default=4, help="chunk requests each receiver keeps outstanding (default 4, as jobs)"
    )
    parser.add_argument("--chunk-mb", type=float, nargs="+", help="chunk sizes in MiB (0 = inline); default 2 8 0")
    parser.add_argument("--receiver-counts", type=int, nargs="+", help="receiver counts; default 1 4")
    parser.add_argument(
        "--repeat", type=int, default=1, help="repetitions of each case, raw and flengine in turn (default 1)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one small case: 64 MiB, 2 MiB chunks, 1 receiver (unless given)"
    )
    parser.add_argument("--insecure", action="store_true", help="plain TCP instead of CURVE")
    parser.add_argument("--out", help="write the JSON result to this file")
    parser.add_argument("--role", choices=("sender", "receiver", "raw-sender", "raw-receiver"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--receivers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--site", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        return run_role(args)
    if args.quick:
        args.chunk_mb, args.receiver_counts = args.chunk_mb or [2], args.receiver_counts or [1]
    if args.size_mb is None:
        args.size_mb = 64 if args.quick else 1024
    if args.transfers < 1 or args.repeat < 1:
        parser.error("--transfers and --repeat must be >= 1")

    model_mb = round(benchnet.layer_count(args.size_mb) * (benchnet.WIDTH**2 + benchnet.WIDTH) * 4 / 2**20, 1)
    chunk_sizes = [round(mb * 2**20) for mb in args.chunk_mb] if args.chunk_mb else CHUNK_SIZES
    counts = args.receiver_counts or RECEIVER_COUNTS
    runs = [
        compared_case(args.size_mb, chunk, n, args, repetition)
        for chunk in chunk_sizes
        for n in counts
        for repetition in range(args.repeat)
    ]
    summary = summarize(runs)
    here = machine()
    print_table(model_mb, runs, summary, args.insecure, here)
    if args.out:
        result = {"model_mb": model_mb, "machine": here, "runs": runs, "summary": summary}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def run_role(args: argparse.Namespace) -> int:
    """A child process: one sender or receiver, flengine's or raw."""
    from engine.runtime.process import return_freed_memory_to_the_system

    return_freed_memory_to_the_system(args.chunk_bytes or 0)  # as a job with this chunk size
    keys = bench_streaming_raw.keys_for(os.environ.get(KEYS_ENV))
    if args.role == "sender":
        run_sender(args.size_mb, args.chunk_bytes, args.receivers, args.transfers)
    elif args.role == "receiver":
        run_receiver(args.endpoint, args.site, args.size_mb, args.transfers, args.in_flight)
    elif args.role == "raw-sender":
        bench_streaming_raw.serve(args.size_mb, args.chunk_bytes, keys, report)
    else:
        bench_streaming_raw.receive(
            args.endpoint, args.site, args.size_mb, args.transfers, args.in_flight, keys, report
        )
    return 0


def report(line: str) -> None:
    """Tell the parent process (one line on stdout)."""
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
