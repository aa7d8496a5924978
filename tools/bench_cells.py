"""Benchmark of the cells layer: round trip and bulk throughput between two processes.

The parent process runs a client cell; a child process runs the server cell, which answers
``bench/ping`` with an empty reply and ``bench/chunk`` with one body frame of the requested
size, sent zero-copy from a preallocated buffer (as the streaming layer serves chunks). Both talk
over TCP loopback. ``--raw`` measures the same workload with plain pyzmq DEALER/ROUTER sockets
and no cells, which is the ceiling the cells layer is held against.

Both modes use CURVE (fresh key pairs made by the parent, the server's allowlist holding the
client's key), as every flengine connection does; ``--insecure`` measures them over plain TCP.
Compare cells with raw pyzmq of the same security, run in turn on the same host.

``--raw --connections K`` spreads each pull over K connections (K DEALER sockets, requests dealt
in turn, each end with K ZeroMQ I/O threads): libzmq encrypts and decrypts a connection's
traffic on the one I/O thread that owns it, so this measures what more than one connection per
transfer could gain on the host, before any such thing is built into cells.

Usage::

    python tools/bench_cells.py [--out FILE] [--raw [--connections K]] [--insecure] [--inline]
                                [--glibc-malloc] [--repeat N] [--total-mib MIB]

Both processes set glibc's allocator as flengine's job processes do for a job whose largest
chunk is the largest frame measured (`engine.runtime.process.return_freed_memory_to_the_system`):
ZeroMQ mallocs every received frame, and with glibc's defaults each one above its mmap
threshold is a fresh mapping, page-faulted in again. ``--glibc-malloc`` keeps glibc's defaults,
in either mode.

Prints a table and writes JSON::

    {"mode": "cell", "rtt_p50_us": ..., "rtt_p99_us": ...,
     "throughput_gib_s": {"2MiBx1": ..., "2MiBx4": ..., ..., "8MiBx8": ...}, ...}

Each figure is the median of ``--repeat`` runs; the ``*_runs`` keys hold every run, so the
spread on a noisy machine is on record.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FRAME_SIZES_MIB = (2, 8)
IN_FLIGHT = (1, 4, 8)
MAX_FRAME_BYTES = max(FRAME_SIZES_MIB) << 20
#: How the parent hands the child its CURVE keys (absent: plain TCP).
KEYS_ENV = "BENCH_CELLS_CURVE_KEYS"
REQUEST_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 30.0


def make_keys() -> dict[str, str]:
    """Key pairs of the server and the client (Z85 text), as a job's cells have."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {
        "server_public": server_public.decode(),
        "server_secret": server_secret.decode(),
        "client_public": client_public.decode(),
        "client_secret": client_secret.decode(),
    }


def keys_from_environment() -> dict[str, bytes] | None:
    text = os.environ.get(KEYS_ENV)
    return None if not text else {name: value.encode() for name, value in json.loads(text).items()}


def cell_security(keys: dict[str, bytes] | None, server: bool):  # noqa: ANN201 - a CellSecurity or None
    from engine.cells.security import Allowlist, CellSecurity

    if keys is None:
        return None
    if server:
        allowlist = Allowlist({"site-1": keys["client_public"]})
        return CellSecurity(keys["server_public"], keys["server_secret"], allowlist=allowlist)
    return CellSecurity(keys["client_public"], keys["client_secret"], server_public_key=keys["server_public"])


def set_malloc_as_jobs_do() -> bool:
    """Set glibc's allocator as a job process with chunks of the largest frame here; False without glibc."""
    from engine.runtime.process import return_freed_memory_to_the_system

    return return_freed_memory_to_the_system(MAX_FRAME_BYTES)


# ----------------------------------------------------------------------------- servers


def serve_cell(inline: bool) -> None:
    """Child process: a server cell with the bench handlers; ends when stdin closes.

    With ``inline`` the handlers run on the cell's I/O thread (``register_handler(inline=True)``,
    as a non-blocking chunk server does) instead of its handler pool.
    """
    from engine.cells import Cell, CellSettings, Reply

    chunk = memoryview(os.urandom(MAX_FRAME_BYTES))
    security = cell_security(keys_from_environment(), server=True)
    cell = Cell("server", CellSettings(port=0, handler_pool_size=4), security=security)
    cell.register_handler("bench", "ping", lambda message: None, inline=inline)
    cell.register_handler(
        "bench", "chunk", lambda message: Reply(frames=[chunk[: message.header["size"]]]), inline=inline
    )
    with cell:
        print(cell.endpoint, flush=True)
        sys.stdin.read()


def serve_raw(connections: int) -> None:
    """Child process: a plain ROUTER answering the same workload; ends when stdin closes.

    With keys it is a CURVE server (no ZAP handler: raw pyzmq checks no allowlist). Its context
    has an I/O thread per connection the client makes.
    """
    chunk = memoryview(os.urandom(MAX_FRAME_BYTES))
    context = zmq.Context(io_threads=connections)
    router = context.socket(zmq.ROUTER)
    keys = keys_from_environment()
    if keys is not None:
        router.curve_secretkey, router.curve_publickey = keys["server_secret"], keys["server_public"]
        router.curve_server = True
    router.bind("tcp://127.0.0.1:*")
    print(router.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        if not router.poll(100):
            continue
        routing_id, kind, size = router.recv_multipart()
        if kind == b"ping":
            router.send_multipart([routing_id, b"pong"])
        else:
            router.send_multipart([routing_id, b"chunk", chunk[: int(size)]], copy=False)
    router.close(linger=0)
    context.term()


# ----------------------------------------------------------------------------- clients


class CellClient:
    """Drives the cell server from the parent process."""

    def __init__(self, endpoint: str, keys: dict[str, bytes] | None) -> None:
        from engine.cells import Cell, CellSettings

        security = cell_security(keys, server=False)
        self.cell = Cell("site-1", CellSettings(), connect_to=endpoint, security=security).start()
        if not self.cell.wait_connected(STARTUP_TIMEOUT_S):
            raise RuntimeError(f"client cell did not register with {endpoint}")

    def ping(self) -> None:
        self.cell.request("server", "bench", "ping", timeout_s=REQUEST_TIMEOUT_S)

    def pull(self, size: int, count: int, in_flight: int) -> None:
        window: collections.deque = collections.deque()
        issued = 0
        while issued < min(in_flight, count):
            window.append(self._ask(size))
            issued += 1
        while window:
            reply = window.popleft().result(REQUEST_TIMEOUT_S).raise_for_status()
            assert reply.frames[0].nbytes == size
            if issued < count:
                window.append(self._ask(size))
                issued += 1

    def _ask(self, size: int):  # noqa: ANN202 - a ReplyFuture
        return self.cell.request_async("server", "bench", "chunk", header={"size": size}, timeout_s=REQUEST_TIMEOUT_S)

    def close(self) -> None:
        self.cell.stop()


class RawClient:
    """Drives the plain pyzmq server from the parent process, over one connection or several."""

    def __init__(self, endpoint: str, keys: dict[str, bytes] | None, connections: int = 1) -> None:
        self.context = zmq.Context(io_threads=connections)
        self.dealers = []
        for _ in range(connections):
            dealer = self.context.socket(zmq.DEALER)
            if keys is not None:
                dealer.curve_secretkey, dealer.curve_publickey = keys["client_secret"], keys["client_public"]
                dealer.curve_serverkey = keys["server_public"]
            dealer.connect(endpoint)
            self.dealers.append(dealer)
        self.dealer = self.dealers[0]
        self.poller = zmq.Poller()
        for dealer in self.dealers:
            self.poller.register(dealer, zmq.POLLIN)

    def ping(self) -> None:
        self.dealer.send_multipart([b"ping", b"0"])
        self.dealer.recv_multipart()

    def pull(self, size: int, count: int, in_flight: int) -> None:
        """``count`` frames of ``size`` bytes, ``in_flight`` asked at a time, dealt over the connections in turn."""
        request = [b"chunk", str(size).encode()]
        issued = received = 0
        while issued < min(in_flight, count):
            self.dealers[issued % len(self.dealers)].send_multipart(request)
            issued += 1
        while received < count:
            ready = self.poller.poll(REQUEST_TIMEOUT_S * 1000)
            if not ready:
                raise TimeoutError("raw server did not answer")
            for dealer, _ in ready:
                while received < count and dealer.poll(0):
                    frames = dealer.recv_multipart(copy=False)
                    assert len(frames[1]) == size
                    received += 1
                    if issued < count:
                        dealer.send_multipart(request)  # the next request on the connection that is free
                        issued += 1

    def close(self) -> None:
        for dealer in self.dealers:
            dealer.close(linger=0)
        self.context.term()


# ----------------------------------------------------------------------------- measuring


def measure_rtt(ping: Callable[[], None], count: int) -> list[float]:
    """Return ``count`` round trips in microseconds, after a warm-up."""
    for _ in range(max(50, count // 10)):
        ping()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        ping()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure_throughput(client: CellClient | RawClient, size_mib: int, in_flight: int, total_mib: int) -> float:
    """Pull ``total_mib`` MiB in frames of ``size_mib`` MiB; return GiB/s."""
    size = size_mib << 20
    count = max(in_flight, total_mib // size_mib)
    client.pull(size, min(count, 2 * in_flight), in_flight)  # warm-up
    start = time.perf_counter()
    client.pull(size, count, in_flight)
    elapsed = time.perf_counter() - start
    return count * size / elapsed / (1 << 30)


def run(
    raw: bool,
    repeat: int,
    total_mib: int,
    rtt_count: int,
    malloc: str,
    inline: bool = False,
    insecure: bool = False,
    connections: int = 1,
) -> dict:
    mode = "raw" if raw else ("cell-inline" if inline else "cell")
    key_text = None if insecure else make_keys()
    env = dict(os.environ)
    if key_text is not None:
        env[KEYS_ENV] = json.dumps(key_text)
    keys = None if key_text is None else {name: value.encode() for name, value in key_text.items()}
    child = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--serve",
            mode,
            f"--connections={connections}",
            *(["--glibc-malloc"] * (malloc == "glibc")),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        endpoint = child.stdout.readline().strip()
        if not endpoint.startswith("tcp://"):
            raise RuntimeError(f"benchmark server did not start (said {endpoint!r})")
        client = RawClient(endpoint, keys, connections) if raw else CellClient(endpoint, keys)
        try:
            result = _measure(client, mode, repeat, total_mib, rtt_count)
            result["malloc"] = malloc
            result["security"] = "none" if insecure else "curve"
            result["connections"] = connections
            return result
        finally:
            client.close()
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _measure(client: CellClient | RawClient, mode: str, repeat: int, total_mib: int, rtt_count: int) -> dict:
    rtt_runs: list[dict[str, float]] = []
    tput_runs: dict[str, list[float]] = {f"{s}MiBx{n}": [] for s in FRAME_SIZES_MIB for n in IN_FLIGHT}
    for _ in range(repeat):
        samples = measure_rtt(client.ping, rtt_count)
        rtt_runs.append({"p50": percentile(samples, 0.50), "p99": percentile(samples, 0.99)})
        for size_mib in FRAME_SIZES_MIB:
            for in_flight in IN_FLIGHT:
                tput_runs[f"{size_mib}MiBx{in_flight}"].append(
                    measure_throughput(client, size_mib, in_flight, total_mib)
                )
    return {
        "mode": mode,
        "rtt_p50_us": round(statistics.median(r["p50"] for r in rtt_runs), 1),
        "rtt_p99_us": round(statistics.median(r["p99"] for r in rtt_runs), 1),
        "throughput_gib_s": {k: round(statistics.median(v), 3) for k, v in tput_runs.items()},
        "rtt_runs_us": [{k: round(v, 1) for k, v in r.items()} for r in rtt_runs],
        "throughput_gib_s_runs": {k: [round(x, 3) for x in v] for k, v in tput_runs.items()},
        "repeat": repeat,
        "total_mib_per_case": total_mib,
        "rtt_samples_per_run": rtt_count,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
        },
    }


def print_table(result: dict) -> None:
    print(f"mode: {result['mode']}, security {result['security']}, malloc as {result['malloc']}", end="")
    print(f", {result['connections']} connection(s)", end="")
    print(f"  (median of {result['repeat']} runs, min-max in brackets)")
    p50 = [r["p50"] for r in result["rtt_runs_us"]]
    p99 = [r["p99"] for r in result["rtt_runs_us"]]
    print(f"{'rtt p50 (us)':<16}{result['rtt_p50_us']:>10.1f}   [{min(p50):.0f}-{max(p50):.0f}]")
    print(f"{'rtt p99 (us)':<16}{result['rtt_p99_us']:>10.1f}   [{min(p99):.0f}-{max(p99):.0f}]")
    print(f"{'frame x flight':<16}{'GiB/s':>10}")
    for case, value in result["throughput_gib_s"].items():
        runs = result["throughput_gib_s_runs"][case]
        print(f"{case:<16}{value:>10.2f}   [{min(runs):.2f}-{max(runs):.2f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON result to this file")
    parser.add_argument(
        "--raw", action="store_true", help="measure plain pyzmq DEALER/ROUTER instead of cells (the ceiling)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (default 3)")
    parser.add_argument(
        "--total-mib", type=int, default=2048, help="MiB pulled per throughput case and run (default 2048)"
    )
    parser.add_argument("--rtt-count", type=int, default=2000, help="round trips timed per run (default 2000)")
    parser.add_argument(
        "--glibc-malloc", action="store_true", help="keep glibc's allocator defaults instead of flengine's setting"
    )
    parser.add_argument(
        "--inline", action="store_true", help="cells only: run the server's handlers on its I/O thread (inline=True)"
    )
    parser.add_argument("--insecure", action="store_true", help="plain TCP instead of CURVE, in either mode")
    parser.add_argument(
        "--connections", type=int, default=1, help="raw only: connections (and I/O threads) a pull is spread over"
    )
    parser.add_argument("--serve", choices=("cell", "cell-inline", "raw"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    malloc = "glibc" if args.glibc_malloc or not set_malloc_as_jobs_do() else "flengine"
    if args.serve in ("cell", "cell-inline"):
        serve_cell(inline=args.serve == "cell-inline")
        return 0
    if args.connections < 1 or (args.connections > 1 and not (args.raw or args.serve == "raw")):
        parser.error("--connections: at least 1, and more than 1 only with --raw")
    if args.serve == "raw":
        serve_raw(args.connections)
        return 0
    result = run(
        args.raw, args.repeat, args.total_mib, args.rtt_count, malloc, args.inline, args.insecure, args.connections
    )
    print_table(result)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
