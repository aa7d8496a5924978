"""Benchmark of tensor streaming: a BenchNet state dict from one process to N others, via FOBS.

    python tools/bench_streaming.py --size-mb 1024 [--transfers 2] [--insecure] [--out FILE]

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
Prints a table and writes JSON:
``{"model_mb": N, "runs": [{"chunk_bytes", "receivers", "throughput_gib_s",
"warm_throughput_gib_s", "sender_peak_rss_mb", "receiver_peak_rss_mb", ...}, ...]}``.
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

import benchnet  # noqa: E402
import zmq  # noqa: E402

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


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set (or, with ``VmHWM``, its peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


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
        start = time.perf_counter()
        reply = cell.request("server", "bench", f"get-{transfer}", timeout_s=TIMEOUT_S)
        streaming = StreamingContext(cell, per_request_timeout_s=TIMEOUT_S, max_in_flight=in_flight)
        context = fobs.DecodeContext(props={STREAMING_PROP: streaming})
        tensors = fobs.deserialize(reply.frames[0], reply.frames[1:], context, registry)
        del reply  # inline frames are no longer needed once the tensors are rebuilt
        seconds = time.perf_counter() - start
        PAGE_POPULATOR.wait_idle()  # a last madvise may still walk pages the transfer wrote
        populating = PAGE_POPULATOR.populate_seconds - populating_before
        peak = rss_mb("VmHWM")
        wrong = benchnet.mismatches(tensors, size_mb)
        del tensors
        print(f"RESULT {seconds:.4f} {baseline:.1f} {peak:.1f} {len(wrong)} {populating:.4f}", flush=True)
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
    size_mb: float, chunk_bytes: int, receivers: int, transfers: int, in_flight: int, insecure: bool = False
) -> dict:
    env = dict(os.environ)
    env.pop(KEYS_ENV, None)
    if not insecure:
        env[KEYS_ENV] = json.dumps(make_keys(receivers))
    sender = spawn("--role", "sender", "--size-mb", str(size_mb), "--chunk-bytes", str(chunk_bytes),
                   "--receivers", str(receivers), "--transfers", str(transfers), env=env)  # fmt: skip
    children = [sender]
    try:
        endpoint, sender_baseline, sender_model = expect(sender, "READY")
        readers = [spawn("--role", "receiver", "--endpoint", endpoint, "--site", f"site-{k}", "--size-mb", str(size_mb),
                         "--transfers", str(transfers), "--in-flight", str(in_flight),
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
        "warm_throughput_gib_s": round(statistics.mean(model_bytes / s for s in warm_seconds) / 2**30, 3)
        if warm_seconds
        else None,
        "warm_seconds": [round(s, 3) for s in warm_seconds],
        "sender_peak_rss_mb": float(sender_peak),
        "sender_baseline_mb": float(sender_baseline),
        "sender_model_rss_mb": float(sender_model),
        "sender_extra_mb": round(float(sender_peak) - float(sender_model), 1),
        "receiver_peak_rss_mb": max(float(r[2]) for r in every),
        "receiver_baseline_mb": max(float(r[1]) for r in every),
        "mismatched_tensors": sum(int(r[3]) for r in every),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="BenchNet size in MiB (default 1024)")
    parser.add_argument(
        "--transfers", type=int, default=2, help="transfers per receiver process, the first cold (default 2)"
    )
    parser.add_argument(
        "--in-flight", type=int, default=4, help="chunk requests each receiver keeps outstanding (default 4, as jobs)"
    )
    parser.add_argument("--chunk-mb", type=float, nargs="+", help="chunk sizes in MiB (0 = inline); default 2 8 0")
    parser.add_argument("--receiver-counts", type=int, nargs="+", help="receiver counts; default 1 4")
    parser.add_argument("--insecure", action="store_true", help="plain TCP instead of CURVE")
    parser.add_argument("--out", help="write the JSON result to this file")
    parser.add_argument("--role", choices=("sender", "receiver"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--receivers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--site", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        from engine.runtime.process import return_freed_memory_to_the_system

        return_freed_memory_to_the_system(args.chunk_bytes or 0)  # as a job with this chunk size
    if args.role == "sender":
        run_sender(args.size_mb, args.chunk_bytes, args.receivers, args.transfers)
        return 0
    if args.role == "receiver":
        run_receiver(args.endpoint, args.site, args.size_mb, args.transfers, args.in_flight)
        return 0

    model_mb = round(benchnet.layer_count(args.size_mb) * (benchnet.WIDTH**2 + benchnet.WIDTH) * 4 / 2**20, 1)
    if args.transfers < 1:
        parser.error("--transfers must be >= 1")
    chunk_sizes = [round(mb * 2**20) for mb in args.chunk_mb] if args.chunk_mb else CHUNK_SIZES
    counts = args.receiver_counts or RECEIVER_COUNTS
    runs = [
        run_case(args.size_mb, chunk, n, args.transfers, args.in_flight, args.insecure)
        for chunk in chunk_sizes
        for n in counts
    ]
    security = "plain TCP (--insecure)" if args.insecure else "CURVE"
    print(f"BenchNet {model_mb} MiB, sender -> receivers over TCP loopback, {security} (peak RSS = VmHWM, MiB)")
    print("cold / min / warm: GiB/s per transfer; fault-in: CPU seconds the page populator spent on a cold one")
    widths = {"chunk": 7, "recv": 4, "cold": 6, "min": 6, "fault-in": 8, "warm": 6, "send peak": 9, "send extra": 10}
    widths |= {"recv peak": 9, "recv base": 9, "bad": 3}
    print(" ".join(f"{name:>{width}}" for name, width in widths.items()))
    for run in runs:
        chunk = f"{run['chunk_bytes'] >> 20}MiB" if run["chunk_bytes"] else "inline"
        warm = "-" if run["warm_throughput_gib_s"] is None else f"{run['warm_throughput_gib_s']:.2f}"
        fault_in = f"{statistics.mean(run['cold_fault_in_seconds']):.2f}"
        cells = [chunk, run["receivers"], f"{run['throughput_gib_s']:.2f}", f"{run['throughput_gib_s_min']:.2f}"]
        cells += [fault_in, warm]
        cells += [f"{run[key]:.0f}" for key in ("sender_peak_rss_mb", "sender_extra_mb", "receiver_peak_rss_mb")]
        cells += [f"{run['receiver_baseline_mb']:.0f}", run["mismatched_tensors"]]
        print(" ".join(f"{cell!s:>{width}}" for cell, width in zip(cells, widths.values(), strict=True)))
    if args.out:
        Path(args.out).write_text(json.dumps({"model_mb": model_mb, "runs": runs}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
