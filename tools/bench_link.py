"""Rounds at the speed of the link: a production-mode FedAvg job whose server sits behind a shaped link.

    sudo python tools/bench_link.py --size-mb 256 --clients 2 --rate-mbit 1000 --rounds 3 --out link.json
    sudo python tools/bench_link.py --size-mb 16 --clients 2 --rate-mbit 200 --quantize fp16 --out q.json
    sudo python tools/bench_link.py ... --mode production     # daemons started by their kits' start.sh

It runs tools/bench.py's job (BenchNet of ``--size-mb`` MiB, FedAvg, client k adds ``k * 0.001``
with weight ``k * 100``) the way bench.py's ``--mode poc`` does (provision a project, start the
server and site daemons, submit with ``flengine admin``, wait for the job's final record, check
the final global model), but with the server, each site and the admin in network namespaces of
their own, joined by a Linux bridge, the server's link shaped to ``--rate-mbit``::

    flb-<pid>-srv  eth0 10.77.0.1 ─┐  (tbf on eth0: server -> bridge)
    flb-<pid>-s1   eth0 10.77.0.11 ─┤
    ...                            ├─ flb-<pid>-sw: bridge br0 (tbf on port srv: bridge -> server)
    flb-<pid>-sN   eth0 10.77.0.1N ─┤
    flb-<pid>-adm  eth0 10.77.0.254 ┘

tbf shapes egress only, so the server's link is shaped on both ends of its veth pair: the
server-side ``eth0`` (what the server sends) and the bridge-side ``srv`` (what it receives).
The project names the server by 10.77.0.1; each daemon runs under ``ip netns exec``; the
addresses exist only inside these namespaces. ``--mode poc`` (default) starts the daemons as
bench.py does (``python -m engine server|client start KIT``), ``--mode production`` through each
kit's own ``start.sh``; both are production-mode daemons with CURVE.

Rounds: each round's ``time_s`` from the server's ``round_done`` events (bench.py's figures).
Bytes: the server's ``eth0`` counters (``/sys/class/net/eth0/statistics/{rx,tx}_bytes``, read
inside its namespace, Ethernet frames with their headers), sampled at round boundaries: as the
server's ``events.jsonl`` (polled every 10 ms) gets ``round_started`` and ``round_done``, so a
round's bytes are what crossed the link between its start and its end (the job's deployment
before round 1 is outside every round; the admin's few status polls cross the link too).
``steady_round_s`` and ``server_link_bytes`` are medians over the rounds after the first;
``link_bound_s = server_link_bytes * 8 / (rate_mbit * 1e6)``, the time the link alone needs, and
``ratio = steady_round_s / link_bound_s``. The JSON (``--out``) also has the settings, every
round's figures, the totals and the model check; one summary line goes to stdout.

``--quantize fp16|bf16|int8|int4`` adds ``engine.filters.quantize.Quantize`` to the job (the server's
``task_data_filters`` and the clients' ``task_result_filters`` for ``train``); the model check
then allows each rounding per round (``rounds * {fp16: 1e-3, bf16: 1e-2} * max|value|`` of each
tensor, int8: ``rounds * 1e-2 * (max - min)``, int4: ``rounds * 0.15 * (max - min)``) and reports
the worst error against it.

Needs root (namespaces, veth, tc). Whatever it made is removed in a ``finally``, on Ctrl-C,
SIGTERM or failure too: the processes in its namespaces are stopped, the namespaces deleted,
the temp folder removed (unless ``--keep``). Names carry the tool's pid, so runs do not collide.
Exit code 0 when the job completed with the right model, 1 when not, 2 when it could not set up
the namespaces, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402
import benchnet  # noqa: E402
from soak import json_object_or_none  # noqa: E402

SUBNET = "10.77.0"
SERVER_ADDRESS = f"{SUBNET}.1"
ADMIN_ADDRESS = f"{SUBNET}.254"
#: The server daemon's port inside its namespace (its jobs take the next ten); the namespace is
#: the tool's own, so no other process can hold it.
SERVER_PORT = 8002
MAX_CLIENTS = 200
#: Every namespace device facing the bridge is ``eth0``; the bridge's ports are named after their peer.
DEVICE = "eth0"
BRIDGE = "br0"
#: tbf's queue: the longest a packet may wait for tokens before tbf drops it.
TBF_LATENCY_MS = 100
EVENTS_POLL_S = 0.01
#: The job's status is asked this often until its server logs ``job_done`` (each ``flengine admin``
#: call is a process start: seconds of CPU on a small machine), then at once.
STATUS_POLL_S = 10.0
#: Tolerance of the model check per round of quantization, as a fraction of each tensor's
#: ``max|value|`` (fp16, bf16) or ``max - min`` (int8, int4): two roundings a round (to the clients, back).
QUANTIZE_TOLERANCE = {"fp16": 1e-3, "bf16": 1e-2, "int8": 1e-2, "int4": 0.15}
#: The blockwise modes, whose tolerance is a share of ``max - min``.
BLOCKWISE = ("int8", "int4")


class SetupError(RuntimeError):
    """The namespaces, links or shaping could not be made (not root, no ``ip``/``tc``, ...)."""


@dataclass
class Topology:
    """The namespaces of one run and their names; `create` makes them, `destroy` removes them."""

    pid: int
    clients: int
    rate_mbit: float
    made: list[str] = field(default_factory=list)

    def ns(self, role: str) -> str:
        return f"flb-{self.pid}-{role}"

    @property
    def server(self) -> str:
        return self.ns("srv")

    @property
    def admin(self) -> str:
        return self.ns("adm")

    def site(self, k: int) -> str:
        return self.ns(f"s{k}")

    @property
    def names(self) -> list[str]:
        return [self.ns("sw"), self.server, *(self.site(k) for k in range(1, self.clients + 1)), self.admin]

    @property
    def burst_bytes(self) -> int:
        """tbf's bucket: at least 256 KiB (several 64 KiB GSO packets), or 1 ms at the rate."""
        return max(256 * 1024, int(self.rate_mbit * 1e6 / 8 / 1000))

    def create(self) -> None:
        switch = self.ns("sw")
        self._add(switch)
        _run("ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", switch, "link", "set", BRIDGE, "up")
        ends = [("srv", self.server, SERVER_ADDRESS)]
        ends += [(f"s{k}", self.site(k), f"{SUBNET}.{10 + k}") for k in range(1, self.clients + 1)]
        ends.append(("adm", self.admin, ADMIN_ADDRESS))
        for port, namespace, address in ends:
            self._add(namespace)
            _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", DEVICE, "netns", namespace)
            _run("ip", "-n", switch, "link", "set", port, "master", BRIDGE, "up")
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", DEVICE)
            _run("ip", "-n", namespace, "link", "set", DEVICE, "up")
        for namespace, device in [(self.server, DEVICE), (switch, "srv")]:  # both directions: tbf shapes egress
            _run(
                "ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                "rate", f"{self.rate_mbit:g}mbit", "burst", str(self.burst_bytes), "latency", f"{TBF_LATENCY_MS}ms",
            )  # fmt: skip

    def _add(self, namespace: str) -> None:
        done = subprocess.run(["ip", "netns", "add", namespace], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SetupError(f"cannot create network namespace {namespace}: {done.stderr.strip()}")
        self.made.append(namespace)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")

    def destroy(self, grace_s: float = 10.0) -> list[int]:
        """Stop every process left in the namespaces (SIGTERM, then SIGKILL), delete them; the pids stopped."""
        stopped = []
        for signum in (signal.SIGTERM, signal.SIGKILL):
            pids = [pid for namespace in self.made for pid in namespace_pids(namespace)]
            for pid in pids:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
            stopped += [pid for pid in pids if pid not in stopped]
            deadline = time.monotonic() + grace_s
            while pids and time.monotonic() < deadline and any(_alive(pid) for pid in pids):
                time.sleep(0.1)
        for namespace in reversed(self.made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self.made.clear()
        return stopped

    def exec_prefix(self, namespace: str) -> list[str]:
        return ["ip", "netns", "exec", namespace]


class LinkCounters:
    """The server's ``eth0`` counters, read from sysfs inside its namespace by a shell started there
    once (``ip netns exec`` mounts that namespace's sysfs): a read costs a pipe round trip, no
    process start, so a sample lands within about a millisecond of the event that asked for it."""

    def __init__(self, namespace: str) -> None:
        statistics_dir = f"/sys/class/net/{DEVICE}/statistics"
        script = (
            f"while read -r _; do read -r rx < {statistics_dir}/rx_bytes; read -r tx < {statistics_dir}/tx_bytes; "
            'echo "$rx $tx"; done'
        )
        self._shell = subprocess.Popen(
            ["ip", "netns", "exec", namespace, "sh", "-c", script],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._ask, self._answers = self._shell.stdin, self._shell.stdout
        self._lock = threading.Lock()

    def read(self) -> tuple[int, int]:
        """``(rx_bytes, tx_bytes)`` now."""
        with self._lock:
            if self._ask is None or self._answers is None:
                raise RuntimeError("the link counters are closed")
            self._ask.write("\n")
            self._ask.flush()
            line = self._answers.readline()
        words = line.split()
        if len(words) != 2:
            raise RuntimeError(f"cannot read the server's {DEVICE} counters (got {line!r})")
        return int(words[0]), int(words[1])

    def close(self) -> None:
        with self._lock:
            if self._ask is not None:
                self._ask.close()
            self._ask = None
        try:
            self._shell.wait(5)
        except subprocess.TimeoutExpired:
            self._shell.kill()
            self._shell.wait()


def namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    return [int(word) for word in done.stdout.split()] if done.returncode == 0 else []


def _alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[-1].startswith("Z")  # a zombie is gone
    except OSError:
        return False


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SetupError(f"{' '.join(command)}: {done.stderr.strip() or f'exit {done.returncode}'}")


class RoundBytes(threading.Thread):
    """Follows the server's ``events.jsonl`` (once `follow` names it) and reads the link's counters
    as each round starts and ends: ``samples[(event, round)] = (rx, tx)``."""

    def __init__(self, counters: LinkCounters) -> None:
        super().__init__(daemon=True)
        self.counters = counters
        self.samples: dict[tuple[str, int], tuple[int, int]] = {}
        #: Set once the server logs ``job_done``.
        self.job_done = threading.Event()
        self._events: Path | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    def follow(self, events: Path) -> None:
        self._events = events

    def stop(self) -> None:
        self._stopping.set()
        self.join(30)

    def run(self) -> None:
        offset, pending = 0, ""
        try:
            while True:
                stopping = self._stopping.is_set()  # read the file once more after stop, for the last events
                if self._events is not None and self._events.exists():
                    with self._events.open(encoding="utf-8") as file:
                        file.seek(offset)
                        pending += file.read()
                        offset = file.tell()
                    *lines, pending = pending.split("\n")
                    events = [event for event in map(json_object_or_none, lines) if event is not None]
                    marks = [(e["event"], e["round"]) for e in events if _is_round_mark(e)]
                    if any(e.get("event") == "job_done" for e in events):
                        self.job_done.set()
                    if marks:
                        counters = self.counters.read()
                        for mark in marks:
                            self.samples.setdefault(mark, counters)
                if stopping:
                    return
                self._stopping.wait(EVENTS_POLL_S)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            self.error = error

    def span(self, first: int, last: int) -> int | None:
        """Bytes (rx + tx) from round ``first``'s start to round ``last``'s end; None when unsampled."""
        start, end = self.samples.get(("round_started", first)), self.samples.get(("round_done", last))
        return None if start is None or end is None else end[0] - start[0] + end[1] - start[1]

    def per_round(self, rounds: int) -> list[dict[str, int]]:
        figures = []
        for number in range(1, rounds + 1):
            start, end = self.samples.get(("round_started", number)), self.samples.get(("round_done", number))
            if start is None or end is None:
                continue
            rx, tx = end[0] - start[0], end[1] - start[1]
            figures.append({"round": number, "rx_bytes": rx, "tx_bytes": tx, "bytes": rx + tx})
        return figures


def _is_round_mark(event: dict[str, Any]) -> bool:
    return event.get("event") in ("round_started", "round_done") and "round" in event


def write_job(folder: Path, point: bench.Point, quantize: str | None) -> Path:
    """bench.py's job; with ``quantize``, the Quantize filter on the server's task data and the clients' results."""
    job = bench.write_job(folder, point)
    if quantize is not None:
        chain = (
            "[{ tasks = [train], filters = [{ path = engine.filters.quantize.Quantize, "
            f"args {{ mode = {quantize} }} }}] }}]"
        )
        config = job / "app" / "config"
        for name, key in [
            ("config_fed_server.conf", "task_data_filters"),
            ("config_fed_client.conf", "task_result_filters"),
        ]:
            with (config / name).open("a", encoding="utf-8") as file:
                file.write(f"{key} = {chain}\n")
    return job


def check_quantized_model(path: Path, point: bench.Point, mode: str) -> dict[str, Any]:
    """The final model against ``init + R * D`` with the tolerance of ``mode`` (see QUANTIZE_TOLERANCE)."""
    if not path.exists():
        return {"correct": False, "max_abs_error": float("inf"), "max_error_of_tolerance": float("inf")}
    worst_abs = worst_share = 0.0
    for _, got, expected in bench.model_pairs(path, point):
        if mode in BLOCKWISE:
            scale = (expected.max() - expected.min()).item()
        else:
            scale = expected.abs().max().item()
        tolerance = point.rounds * QUANTIZE_TOLERANCE[mode] * scale
        error = (got - expected).abs().max().item()
        worst_abs = max(worst_abs, error)
        worst_share = max(worst_share, error / tolerance if tolerance > 0 else (0.0 if error == 0 else float("inf")))
    return {"correct": worst_share <= 1.0, "max_abs_error": worst_abs, "max_error_of_tolerance": worst_share}


def model_bytes(size_mb: int) -> int:
    """Bytes of BenchNet(size_mb)'s parameters in float32."""
    return benchnet.layer_count(size_mb) * (benchnet.WIDTH * benchnet.WIDTH + benchnet.WIDTH) * 4


def run(
    args: argparse.Namespace, topology: Topology, root: Path, daemons: list[subprocess.Popen[str]]
) -> dict[str, Any]:
    """Set up the namespaces, run the job in them, measure; return the record. The caller tears down
    ``topology`` and stops ``daemons`` (each daemon started is appended as soon as it runs)."""
    point = bench.Point(args.size_mb, args.clients, False, args.chunk_mb, rounds=args.rounds, mode="poc")
    job = write_job(root / "job", point, args.quantize)
    sites = [f"site-{k}" for k in range(1, args.clients + 1)]
    topology.create()
    bench.provision_project(root, sites, host=SERVER_ADDRESS, port=SERVER_PORT)
    namespaces = {"server": topology.server, **{site: topology.site(k) for k, site in enumerate(sites, 1)}}
    start_daemons(root, namespaces, topology, daemons, kit_script=args.mode == "production")
    admin = topology.exec_prefix(topology.admin)
    bench.wait_connected(root, sites, prefix=admin)
    counters = LinkCounters(topology.server)
    follower = RoundBytes(counters)
    follower.start()
    try:
        before = counters.read()
        job_id, record, seconds = bench.submit_and_wait(
            root, job, prefix=admin,
            on_submitted=lambda job_id: follower.follow(bench.job_workspace(root, job_id) / "server" / "events.jsonl"),
            poll_s=STATUS_POLL_S,
            wake=follower.job_done,
        )  # fmt: skip
        follower.stop()
        after = counters.read()
    finally:
        follower.stop()
        counters.close()
    if follower.error is not None:
        raise RuntimeError(f"reading the link's counters failed: {follower.error}") from follower.error
    workspace = bench.job_workspace(root, job_id)
    result = workspace / "server" / "result.json"
    rounds = json.loads(result.read_text(encoding="utf-8")).get("rounds", []) if result.exists() else []
    final_model = workspace / "server" / "models" / "global.safetensors"
    if args.quantize is None:
        correct, worst = bench.check_model(final_model, point)
        check = {"correct": correct, "max_abs_error": worst, "tolerance": "1e-6 absolute (exact)"}
    else:
        check = check_quantized_model(final_model, point, args.quantize)
        check["tolerance"] = f"rounds * {QUANTIZE_TOLERANCE[args.quantize]:g} of each tensor's " + (
            "max - min" if args.quantize in BLOCKWISE else "max |value|"
        )
    return summarize(args, topology, record, seconds, [r["time_s"] for r in rounds], follower, before, after, check)


def start_daemons(
    root: Path, namespaces: dict[str, str], topology: Topology, daemons: list[subprocess.Popen[str]], kit_script: bool
) -> None:
    """Start the server daemon, then the sites' together (each takes seconds to import); append each to ``daemons``."""
    roles = bench.daemon_roles([name for name in namespaces if name != "server"])

    def start(name: str, role: str) -> None:
        prefix = topology.exec_prefix(namespaces[name])
        daemons.append(bench.start_daemon(root, name, role, prefix, kit_script=kit_script))

    start(*roles[0])
    with ThreadPoolExecutor(max_workers=len(roles) - 1) as pool:
        for started in [pool.submit(start, name, role) for name, role in roles[1:]]:
            started.result()


def summarize(
    args: argparse.Namespace,
    topology: Topology,
    record: dict[str, Any],
    seconds: float,
    round_s: list[float],
    follower: RoundBytes,
    before: tuple[int, int],
    after: tuple[int, int],
    check: dict[str, Any],
) -> dict[str, Any]:
    steady = round_s[1:] or round_s
    steady_round_s = round(statistics.median(steady), 3) if steady else None
    first = 2 if args.rounds > 1 else 1
    span = follower.span(first, args.rounds)
    link_bytes = span // (args.rounds - first + 1) if span is not None else None
    link_bound_s = link_bytes * 8 / (args.rate_mbit * 1e6) if link_bytes is not None else None
    payload = 2 * args.clients * model_bytes(args.size_mb)
    return {
        "settings": {
            "size_mb": args.size_mb,
            "clients": args.clients,
            "rate_mbit": args.rate_mbit,
            "rounds": args.rounds,
            "quantize": args.quantize,
            "mode": args.mode,
            "chunk_mb": args.chunk_mb,
            "security": "curve",
            "tbf_burst_bytes": topology.burst_bytes,
            "tbf_latency_ms": TBF_LATENCY_MS,
            "cpus": os.cpu_count(),
        },
        "topology": {
            "namespaces": topology.names,
            "server_address": f"{SERVER_ADDRESS}:{SERVER_PORT}",
            "shaped": [f"{topology.server}:{DEVICE}", f"{topology.ns('sw')}:srv"],
        },
        "bytes_counted": (
            "server eth0 rx+tx from sysfs in its namespace, sampled as the server logs round_started and "
            "round_done; server_link_bytes: from round 2's start to the last round's end, over those rounds"
        ),
        "status": record["status"],
        "reason": record.get("reason", ""),
        "seconds": round(seconds, 2),
        "round_s": round_s,
        "steady_round_s": steady_round_s,
        "round_link_bytes": follower.per_round(args.rounds),
        "server_link_bytes": link_bytes,
        "total_link_bytes": {"rx_bytes": after[0] - before[0], "tx_bytes": after[1] - before[1]},
        "model_bytes": model_bytes(args.size_mb),
        "fp32_payload_bytes_per_round": payload,
        "link_bytes_of_fp32_payload": round(link_bytes / payload, 4) if link_bytes else None,
        "link_bound_s": round(link_bound_s, 3) if link_bound_s is not None else None,
        "ratio": round(steady_round_s / link_bound_s, 3) if steady_round_s and link_bound_s else None,
        **check,
    }


def summary_line(document: dict[str, Any]) -> str:
    s = document["settings"]
    quantize = f" {s['quantize']}" if s["quantize"] else ""
    check = "model ok" if document["correct"] else f"MODEL WRONG (max error {document['max_abs_error']:.3g})"
    link_bytes = document["server_link_bytes"]
    megabytes = f"{link_bytes / 1e6:.1f} MB" if link_bytes is not None else "? MB"
    return (
        f"{s['size_mb']} MiB x{s['clients']} at {s['rate_mbit']:g} Mbit/s{quantize}: {document['status']}, "
        f"steady round {document['steady_round_s']} s, link {megabytes}/round, "
        f"bound {document['link_bound_s']} s, ratio {document['ratio']}, {check}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 1 <= args.clients <= MAX_CLIENTS or args.rounds < 1 or args.rate_mbit <= 0 or args.size_mb < 1:
        print(
            f"Error: need 1 <= --clients <= {MAX_CLIENTS}, --rounds >= 1, --rate-mbit > 0, --size-mb >= 1",
            file=sys.stderr,
        )
        return 2
    if os.geteuid() != 0:
        print("Error: bench_link.py makes network namespaces and shapes links: run it as root (sudo)", file=sys.stderr)
        return 2
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        print(f"Error: {' and '.join(missing)} not found (install iproute2)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    topology = Topology(os.getpid(), args.clients, args.rate_mbit)
    root = Path(tempfile.mkdtemp(prefix=f"flengine-bench-link-{os.getpid()}-"))
    daemons: list[subprocess.Popen[str]] = []
    document: dict[str, Any] | None = None
    try:
        print(f"bench_link: namespaces {topology.ns('*')}, {args.size_mb} MiB x{args.clients} ...", file=sys.stderr)
        document = run(args, topology, root, daemons)
    except KeyboardInterrupt:
        print("bench_link: interrupted; removing what it made", file=sys.stderr)
        return 130
    except SetupError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.SubprocessError, OSError) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the teardown halfway
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        bench.stop_daemons(daemons, timeout_s=30.0)
        left = topology.destroy()
        if left:
            print(f"bench_link: stopped {len(left)} process(es) left in its namespaces", file=sys.stderr)
        if args.keep:
            print(f"bench_link: kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(summary_line(document))
    return 0 if document["status"] == "FINISHED_COMPLETED" and document["correct"] else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, required=True, help="BenchNet's size in MiB")
    parser.add_argument("--clients", type=int, required=True, help="sites, each in a namespace of its own")
    parser.add_argument("--rate-mbit", type=float, required=True, help="the server link's rate, Mbit/s, each way")
    parser.add_argument("--rounds", type=int, default=3, help="FedAvg rounds (default 3: the first is not steady)")
    parser.add_argument("--quantize", choices=sorted(QUANTIZE_TOLERANCE), help="add engine.filters.quantize.Quantize")
    parser.add_argument(
        "--mode", choices=["poc", "production"], default="poc",
        help="poc: daemons started as bench.py does (default); production: by each kit's start.sh",
    )  # fmt: skip
    parser.add_argument("--chunk-mb", type=float, default=2.0, help="download chunk size, MiB (default 2)")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (kits, workspaces)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
