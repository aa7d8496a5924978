"""Benchmark of tensor streaming: a BenchNet state dict from one process to N others, via FOBS.

    python tools/bench_streaming.py --size-mb 1024 [--out FILE]

For each chunk size (2 MiB, 8 MiB, 0 = inline) and receiver count (1, 4), a sender process
builds BenchNet (BENCHMARK.md), serializes it once with the via-downloader decomposers, and
serves that one message to every receiver; each receiver process pulls it, rebuilds the state
dict, and checks every tensor against BenchNet (regenerated one layer at a time). Every process
sets glibc's allocator as flengine's job processes do. Peak RSS is the kernel's high-water mark
(VmHWM) of each process; ``baseline`` is a process's RSS after its imports, before any tensor
exists. Prints a table and writes JSON:
``{"model_mb": N, "runs": [{"chunk_bytes", "receivers", "throughput_gib_s",
"sender_peak_rss_mb", "receiver_peak_rss_mb", ...}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchnet  # noqa: E402

CHUNK_SIZES = (2 << 20, 8 << 20, 0)
RECEIVER_COUNTS = (1, 4)
TIMEOUT_S = 600.0


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


def run_sender(size_mb: float, chunk_bytes: int, receivers: int) -> None:
    from engine import fobs
    from engine.cells import Cell, CellSettings, Reply
    from engine.streaming.service import DownloadService
    from engine.streaming.via_downloader import RECEIVERS_PROP, STREAMING_PROP, StreamingContext

    baseline = rss_mb()
    tensors = benchnet.state_dict(size_mb)
    model_rss = rss_mb()
    cell = Cell("server", CellSettings(port=0, heartbeat_timeout_s=60.0)).start()
    service = DownloadService(cell)
    context = StreamingContext(cell, service, chunk_bytes, chunk_bytes, TIMEOUT_S, TIMEOUT_S)
    sites = [f"site-{k}" for k in range(1, receivers + 1)]
    props = {STREAMING_PROP: context, RECEIVERS_PROP: sites}
    header, frames = fobs.serialize(tensors, fobs.EncodeContext(props=props), streaming_registry())
    cell.register_handler("bench", "get", lambda message: Reply(frames=[header, *frames]))
    print(f"READY {cell.endpoint} {baseline:.1f} {model_rss:.1f}", flush=True)
    sys.stdin.read()
    print(f"PEAK {rss_mb('VmHWM'):.1f}", flush=True)
    service.close()
    cell.stop()


def run_receiver(endpoint: str, site: str, size_mb: float) -> None:
    from engine import fobs
    from engine.cells import Cell, CellSettings
    from engine.streaming.via_downloader import STREAMING_PROP, StreamingContext

    registry = streaming_registry()
    baseline = rss_mb()
    cell = Cell(site, CellSettings(heartbeat_timeout_s=60.0), connect_to=endpoint).start()
    cell.wait_connected(timeout_s=30)
    print("CONNECTED", flush=True)
    sys.stdin.readline()  # GO
    start = time.perf_counter()
    reply = cell.request("server", "bench", "get", timeout_s=TIMEOUT_S)
    context = fobs.DecodeContext(props={STREAMING_PROP: StreamingContext(cell, per_request_timeout_s=TIMEOUT_S)})
    tensors = fobs.deserialize(reply.frames[0], reply.frames[1:], context, registry)
    del reply  # inline frames are no longer needed once the tensors are rebuilt
    seconds = time.perf_counter() - start
    peak = rss_mb("VmHWM")
    wrong = benchnet.mismatches(tensors, size_mb)
    print(f"RESULT {seconds:.4f} {baseline:.1f} {peak:.1f} {len(wrong)}", flush=True)
    cell.stop()


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def expect(process: subprocess.Popen[str], word: str) -> list[str]:
    line = process.stdout.readline()
    if not line.startswith(word):
        raise RuntimeError(f"expected {word} from a benchmark process, got {line!r} (exit {process.poll()})")
    return line.split()[1:]


def run_case(size_mb: float, chunk_bytes: int, receivers: int) -> dict:
    sender = spawn("--role", "sender", "--size-mb", str(size_mb), "--chunk-bytes", str(chunk_bytes),
                   "--receivers", str(receivers))  # fmt: skip
    children = [sender]
    try:
        endpoint, sender_baseline, sender_model = expect(sender, "READY")
        readers = [spawn("--role", "receiver", "--endpoint", endpoint, "--site", f"site-{k}", "--size-mb", str(size_mb))
                   for k in range(1, receivers + 1)]  # fmt: skip
        children += readers
        for reader in readers:
            expect(reader, "CONNECTED")
        for reader in readers:
            reader.stdin.write("GO\n")
            reader.stdin.flush()
        results = [expect(reader, "RESULT") for reader in readers]
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
    seconds = [float(r[0]) for r in results]
    return {
        "chunk_bytes": chunk_bytes,
        "receivers": receivers,
        "throughput_gib_s": round(statistics.mean(model_bytes / s for s in seconds) / 2**30, 3),
        "throughput_gib_s_min": round(min(model_bytes / s for s in seconds) / 2**30, 3),
        "seconds": [round(s, 3) for s in seconds],
        "sender_peak_rss_mb": float(sender_peak),
        "sender_baseline_mb": float(sender_baseline),
        "sender_model_rss_mb": float(sender_model),
        "sender_extra_mb": round(float(sender_peak) - float(sender_model), 1),
        "receiver_peak_rss_mb": max(float(r[2]) for r in results),
        "receiver_baseline_mb": max(float(r[1]) for r in results),
        "mismatched_tensors": sum(int(r[3]) for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="BenchNet size in MiB (default 1024)")
    parser.add_argument("--out", help="write the JSON result to this file")
    parser.add_argument("--role", choices=("sender", "receiver"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--receivers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--site", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        from engine.runtime.process import return_freed_memory_to_the_system

        return_freed_memory_to_the_system()
    if args.role == "sender":
        run_sender(args.size_mb, args.chunk_bytes, args.receivers)
        return 0
    if args.role == "receiver":
        run_receiver(args.endpoint, args.site, args.size_mb)
        return 0

    model_mb = round(benchnet.layer_count(args.size_mb) * (benchnet.WIDTH**2 + benchnet.WIDTH) * 4 / 2**20, 1)
    runs = [run_case(args.size_mb, chunk, n) for chunk in CHUNK_SIZES for n in RECEIVER_COUNTS]
    print(f"BenchNet {model_mb} MiB, sender -> receivers over TCP loopback (peak RSS = VmHWM, MiB)")
    widths = {"chunk": 7, "recv": 4, "GiB/s": 6, "min": 6, "send peak": 9, "send extra": 10}
    widths |= {"recv peak": 9, "recv base": 9, "bad": 3}
    print(" ".join(f"{name:>{width}}" for name, width in widths.items()))
    for run in runs:
        chunk = f"{run['chunk_bytes'] >> 20}MiB" if run["chunk_bytes"] else "inline"
        cells = [chunk, run["receivers"], f"{run['throughput_gib_s']:.2f}", f"{run['throughput_gib_s_min']:.2f}"]
        cells += [f"{run[key]:.0f}" for key in ("sender_peak_rss_mb", "sender_extra_mb", "receiver_peak_rss_mb")]
        cells += [f"{run['receiver_baseline_mb']:.0f}", run["mismatched_tensors"]]
        print(" ".join(f"{cell!s:>{width}}" for cell, width in zip(cells, widths.values(), strict=True)))
    if args.out:
        Path(args.out).write_text(json.dumps({"model_mb": model_mb, "runs": runs}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
