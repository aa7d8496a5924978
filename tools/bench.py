"""Benchmark of whole jobs: ``flengine run`` on generated BenchNet jobs, measured from outside.

    python tools/bench.py --size-mb 1024 --clients 2 4 --disk off on [--chunk-mb 2] [--out FILE]
    python tools/bench.py --workflow swarm --size-mb 1024 --clients 3 --disk off on
    python tools/bench.py --mode sim poc --size-mb 1024 --clients 2 --disk off
    python tools/bench.py --size-mb 1024 --clients 2 --disk off --rounds 3 --client loop module

For each point of the matrix (workflow x model size x clients x download_to_disk x chunk size)
it writes a job (BENCHMARK.md: BenchNet, client k adds ``k * 0.001``, weight ``k * 100``, R
rounds) of FedAvg, or of Swarm learning (every client trains, the clients aggregate in turn,
download_to_disk on the clients), runs it with ``flengine run`` and samples every 50 ms, from
outside, each process of the run (the server, each site, with their children): RSS
(``/proc/<pid>/statm``), the peak of the tree's sum, and the bytes under the download folders
of every site; PSS (``/proc/<pid>/smaps_rollup``) once a second, because reading it walks the
whole address space (about 40 ms of CPU for a 2.4 GB process: at every sample it took half a
core of this 2-vCPU machine from the job and stretched the interval to 110 ms). The sampler's
own CPU time is in the record. From the workspace it takes the round times and states, and it checks
every parameter of the final global model (the server's; Swarm: site-1's, a result client)
against ``init + R * D`` (tolerance 1e-6). Prints a markdown table and writes JSON
(``{"runs": [...]}``, one object per point) to ``--out``.

``--mode poc`` runs the same job in production mode on this machine instead: it provisions a
project (server on 127.0.0.1, the sites, one admin), starts the server and client daemons as
processes of their own, submits the job with ``flengine admin``, and samples the job processes
the daemons start (and the daemons themselves, reported apart), until the job's record is final.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchnet  # noqa: E402
from proc_tree import is_alive, process_tree, pss_mb, rss_mb  # noqa: E402

JOB_CODE = Path(__file__).resolve().parent / "bench_job"
SAMPLE_INTERVAL_S = 0.05
#: PSS and the process tree cost far more to read than RSS; they are refreshed less often.
PSS_INTERVAL_S = 1.0
TREE_INTERVAL_S = 0.5
MIB = 2**20
#: Peaks of the daemons (poc mode) are kept under this prefix, apart from the job processes'.
DAEMON = "daemon:"


@dataclass
class Point:
    """One run of the matrix."""

    size_mb: int
    clients: int
    download_to_disk: bool
    chunk_mb: float
    rounds: int = 2
    workflow: str = "fedavg"
    insecure: bool = False
    mode: str = "sim"
    aggregator: str = "fedavg"
    client_script: str = "loop"
    execution_mode: str = "in_process"

    @property
    def label(self) -> str:
        disk = "on" if self.download_to_disk else "off"
        security = "insecure" if self.insecure else "curve"
        aggregator = f" aggregator={self.aggregator}" if self.aggregator != "fedavg" else ""
        return (
            f"{self.mode} {self.workflow} {self.size_mb}MiB x{self.clients} disk={disk} "
            f"chunk={self.chunk_mb:g}MiB {security}{aggregator} client={self.client_script} {self.execution_mode}"
        )


#: The client scripts `--client` picks: BENCHMARK.md's loop (``m = flare.receive()``, update
#: ``m.params`` in place, send them), or a script that trains BenchNet as an ``nn.Module`` and
#: receives each round into it (``flare.receive(into=net)``).
CLIENT_SCRIPTS = {"loop": "client.py", "module": "train_module.py"}


#: The FedOpt runs (`--workflow fedopt`): Adam on the server, its state in memory or (with
#: download_to_disk) in files.
FEDOPT_ARGS: dict[str, Any] = {
    "server_optimizer": "adam", "server_lr": 0.01, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-3,
}  # fmt: skip

#: The robust aggregators `--aggregator` picks for FedAvg (BenchNet's clients are honest: the
#: parameters make each one aggregate every result, so the model can still be checked).
AGGREGATORS: dict[str, dict[str, Any] | None] = {
    "fedavg": None,
    "clip": {"path": "engine.aggregators.NormClippingAggregator", "args": {"max_norm": 1e12}},
    "median": {"path": "engine.aggregators.CoordinateMedianAggregator", "args": {}},
    "trimmed": {"path": "engine.aggregators.TrimmedMeanAggregator", "args": {"trim_fraction": 0.25}},
    "krum": {"path": "engine.aggregators.KrumAggregator", "args": {"num_byzantine": 0, "num_selected": 2}},
}


@dataclass
class Peaks:
    """What the sampler saw: per-site peaks, tree peak, download folder peak (all in MiB)."""

    rss_mb: dict[str, float] = field(default_factory=dict)
    pss_mb: dict[str, float] = field(default_factory=dict)
    tree_rss_mb: float = 0.0
    download_dir_mb: float = 0.0
    samples: int = 0
    sampler_cpu_s: float = 0.0
    daemons: dict[int, str] = field(default_factory=dict)  # poc: daemon pid -> its name
    #: Peak RSS of each process by ``"<site> job"`` (the job process) or ``"<site> script"``
    #: (its children: a subprocess training script), apart from the sums above.
    process_rss_mb: dict[str, float] = field(default_factory=dict)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    points = [
        Point(
            size,
            clients,
            disk == "on",
            chunk,
            args.rounds,
            workflow,
            security == "insecure",
            mode,
            aggregator,
            client,
            execution_mode,
        )
        for execution_mode in args.execution_mode
        for client in args.client
        for aggregator in args.aggregator
        for mode in args.mode
        for security in args.security
        for workflow in args.workflow
        for size in args.size_mb
        for clients in args.clients
        for disk in args.disk
        for chunk in args.chunk_mb
    ]
    runs = []
    for point in points:
        print(f"running {point.label} ...", flush=True)
        record = run_poc_point(point, keep=args.keep) if point.mode == "poc" else run_point(point, keep=args.keep)
        runs.append(record)
        print(_row(record), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"runs": runs}, indent=2) + "\n", encoding="utf-8")
    print()
    print("\n".join(markdown_table(runs)))
    return 0 if all(run["correct"] and run["status"] == "FINISHED_COMPLETED" for run in runs) else 1


def run_point(point: Point, keep: bool = False) -> dict[str, Any]:
    """Write the job, run it, sample it, check its model; return the record."""
    root = Path(tempfile.mkdtemp(prefix="flengine-bench-"))
    try:
        job = write_job(root / "job", point)
        workspace = root / "workspace"
        command = [sys.executable, "-m", "engine", "run", str(job), "--workspace", str(workspace)]
        started = time.monotonic()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        peaks = Peaks()
        downloads = lambda: list(workspace.glob("*/downloads"))  # noqa: E731
        sampler = threading.Thread(target=_sample, args=([process.pid], downloads, peaks))
        sampler.start()
        output, _ = process.communicate()
        seconds = time.monotonic() - started
        sampler.join()
        summary = json.loads((workspace / "summary.json").read_text(encoding="utf-8"))
        holder = "site-1" if point.workflow == "swarm" else "server"
        correct, worst = check_model(workspace / holder / "models" / "global.safetensors", point)
        record = _record(point, summary["status"], summary.get("reason", ""), seconds, summary["rounds"], peaks)
        record["self_reported_peak_rss_mb"] = {s: p.get("peak_rss_mb") for s, p in summary["processes"].items()}
        record["output_tail"] = output.splitlines()[-3:] if summary["status"] != "FINISHED_COMPLETED" else []
        return {**record, "correct": correct, "max_abs_error": worst}
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _record(
    point: Point, status: str, reason: str, seconds: float, rounds: list[dict[str, Any]], peaks: Peaks
) -> dict[str, Any]:
    jobs = {site: mb for site, mb in peaks.rss_mb.items() if not site.startswith(DAEMON)}
    jobs_pss = {site: mb for site, mb in peaks.pss_mb.items() if not site.startswith(DAEMON)}
    daemons = {site[len(DAEMON) :]: round(mb, 1) for site, mb in peaks.rss_mb.items() if site.startswith(DAEMON)}
    return {
        **asdict(point),
        "status": status,
        "reason": reason,
        "seconds": round(seconds, 2),
        "round_s": [r["time_s"] for r in rounds],
        "server_peak_rss_mb": round(jobs.get("server", 0.0), 1),
        "server_peak_pss_mb": round(jobs_pss.get("server", 0.0), 1),
        "client_peak_rss_mb": round(max((v for k, v in jobs.items() if k != "server"), default=0.0), 1),
        "client_peak_pss_mb": round(max((v for k, v in jobs_pss.items() if k != "server"), default=0.0), 1),
        "tree_peak_rss_mb": round(peaks.tree_rss_mb, 1),
        "process_peak_rss_mb": {name: round(mb, 1) for name, mb in sorted(peaks.process_rss_mb.items())},
        "download_dir_peak_mb": round(peaks.download_dir_mb, 1),
        "daemon_peak_rss_mb": daemons,
        "samples": peaks.samples,
        "sampler_cpu_s": round(peaks.sampler_cpu_s, 2),
    }


def run_poc_point(point: Point, keep: bool = False) -> dict[str, Any]:
    """The job in production mode on this machine: provision, start the daemons, submit, sample."""
    root = Path(tempfile.mkdtemp(prefix="flengine-bench-poc-"))
    daemons: list[subprocess.Popen[str]] = []
    try:
        job = write_job(root / "job", point)
        sites = [f"site-{k}" for k in range(1, point.clients + 1)]
        provision_project(root, sites)
        for name, role in daemon_roles(sites):
            daemons.append(start_daemon(root, name, role))
        peaks = Peaks()
        stop = threading.Event()

        def downloads() -> list[Path]:
            return [
                *root.glob("server-ws/jobs/*/workspace/*/downloads"),
                *root.glob("site-*-ws/*/workspace/*/downloads"),
            ]

        for process, name in zip(daemons, ["server", *sites], strict=True):
            peaks.daemons[process.pid] = name
        sampler = threading.Thread(target=_sample, args=([p.pid for p in daemons], downloads, peaks, stop))
        sampler.start()
        wait_connected(root, sites)
        job_id, record, seconds = submit_and_wait(root, job)
        stop.set()
        sampler.join()
        workspace = job_workspace(root, job_id)
        outcome = json.loads((workspace / "server" / "result.json").read_text(encoding="utf-8"))
        holder = "site-1" if point.workflow == "swarm" else "server"
        correct, worst = check_model(workspace / holder / "models" / "global.safetensors", point)
        result = _record(point, record["status"], record.get("reason", ""), seconds, outcome["rounds"], peaks)
        return {**result, "correct": correct, "max_abs_error": worst}
    finally:
        stop_daemons(daemons)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


# The production-mode pieces below are shared with tools/bench_link.py, which runs each daemon in
# a network namespace of its own: ``prefix`` is what each command runs under (``ip netns exec NS``).


def provision_project(root: Path, sites: list[str], host: str = "127.0.0.1", port: int | None = None) -> int:
    """Write ``root/project.conf`` (server at ``host:port``, ``sites``, one admin), provision it into
    ``root/kits``; return the port (default: a free block of 11 ports on 127.0.0.1, as POC takes)."""
    from engine.deploy.poc.prepare import free_port_block
    from engine.provision import load_project, provision

    port = free_port_block(11) if port is None else port
    listed = ", ".join(f"{{ name = {site}, org = org-{site} }}" for site in sites)
    project = root / "project.conf"
    project.write_text(
        f"name = bench\nserver {{ host = {host}, port = {port}, org = lab }}\nsites = [ {listed} ]\n"
        "admins = [ { name = admin, org = lab, role = project_admin } ]\n",
        encoding="utf-8",
    )
    provision(load_project(project), root / "kits")
    return port


def daemon_roles(sites: list[str]) -> list[tuple[str, str]]:
    """The daemons of a provisioned project, in start order: ``(name, role)``, the server first."""
    return [("server", "server"), *((site, "client") for site in sites)]


def start_daemon(
    root: Path, name: str, role: str, prefix: Sequence[str] = (), kit_script: bool = False
) -> subprocess.Popen[str]:
    """Start the daemon of kit ``root/kits/name`` (workspace ``root/name-ws``); return once it says it started.

    ``kit_script``: through the kit's own ``start.sh`` (as an operator starts it, ``FLENGINE`` set to
    this interpreter's flengine) instead of ``python -m engine ROLE start KIT``.
    """
    kit, workspace = root / "kits" / name, root / f"{name}-ws"
    env = None
    if kit_script:
        command = [str(kit / "start.sh"), "--workspace", str(workspace)]
        env = {**os.environ, "FLENGINE": str(Path(sys.executable).parent / "flengine")}
    else:
        command = [sys.executable, "-m", "engine", role, "start", str(kit), "--workspace", str(workspace)]
    process = subprocess.Popen(
        [*prefix, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    line = process.stdout.readline() if process.stdout else ""
    if "started" not in line:
        process.kill()
        process.wait()
        raise RuntimeError(f"{name} did not start: {line}")
    return process


def stop_daemons(daemons: list[subprocess.Popen[str]], timeout_s: float = 60.0) -> None:
    """Terminate the daemons, the last started first; kill one that is not gone within ``timeout_s``."""
    for process in reversed(daemons):
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def admin(root: Path, *args: str, prefix: Sequence[str] = ()) -> Any:
    """``flengine admin`` with the kit ``root/kits/admin``, ``--format json``; its parsed output."""
    command = [sys.executable, "-m", "engine", "admin", str(root / "kits" / "admin"), *args, "--format", "json"]
    done = subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"flengine admin {' '.join(args)}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def wait_connected(root: Path, sites: list[str], timeout_s: float = 60.0, prefix: Sequence[str] = ()) -> None:
    """Return once the server lists every site of ``sites`` as connected; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(entry["connected"] for entry in admin(root, "clients", prefix=prefix) if entry["site"] in sites):
            return
        time.sleep(0.5)
    raise RuntimeError(f"sites not connected within {timeout_s:g} s")


def submit_and_wait(
    root: Path,
    job: Path,
    prefix: Sequence[str] = (),
    on_submitted: Callable[[str], None] | None = None,
    poll_s: float = 0.5,
    wake: threading.Event | None = None,
) -> tuple[str, dict[str, Any], float]:
    """Submit ``job``, ask its status every ``poll_s`` until final; return its id, final record and seconds.

    ``on_submitted`` is called with the job id as soon as the server accepted the job. With
    ``wake`` (say, set as the job's server logs ``job_done``) the status is first asked after
    ``poll_s`` or once ``wake`` is set, and then without pause while it is set.
    """
    started = time.monotonic()
    job_id = admin(root, "submit", str(job), prefix=prefix)["job_id"]
    if on_submitted is not None:
        on_submitted(job_id)
    record = admin(root, "status", job_id, prefix=prefix) if wake is None else {"status": "SUBMITTED"}
    while not record["status"].startswith("FINISHED"):
        if wake is None:
            time.sleep(poll_s)
        elif wake.wait(poll_s):
            time.sleep(0.1)
        record = admin(root, "status", job_id, prefix=prefix)
    return job_id, record, time.monotonic() - started


def job_workspace(root: Path, job_id: str) -> Path:
    """The workspace of job ``job_id`` run by the server daemon of ``root`` (server/, site-k/, summary.json)."""
    return root / "server-ws" / "jobs" / job_id / "workspace"


def write_job(folder: Path, point: Point) -> Path:
    """A FedAvg or Swarm job over BenchNet(size_mb) for ``point``."""
    custom = folder / "app" / "custom"
    (folder / "app" / "config").mkdir(parents=True)
    custom.mkdir()
    script_name = CLIENT_SCRIPTS[point.client_script]
    for name in ("benchnet_module.py", script_name):
        shutil.copy(JOB_CODE / name, custom / name)
    chunk = int(point.chunk_mb * MIB)
    streaming = f"tensor_download_chunk_size = {chunk}\nnp_download_chunk_size = {chunk}\n"
    if point.insecure:  # both configs, as the simulator requires
        streaming += "cell { insecure = true }\n"
    (folder / "meta.conf").write_text(
        f'name = bench\nmin_clients = {point.clients}\ndeploy_map {{ app = ["@ALL"] }}\n', encoding="utf-8"
    )
    persistor = (
        "{ id = persistor, path = engine.persistors.PTFileModelPersistor,\n"
        f"  args {{ model {{ path = benchnet_module.BenchNet, args {{ size_mb = {point.size_mb} }} }} }} }}"
    )
    script_args = f"--size-mb {point.size_mb}" if point.client_script == "module" else ""
    script = (
        f"path = engine.executors.ClientAPIExecutor, args {{ task_script_path = {script_name}, "
        f'task_script_args = "{script_args}", execution_mode = {point.execution_mode} }}'
    )
    if point.workflow == "swarm":
        server = {"num_rounds": point.rounds, "start_task_timeout": 300, "progress_timeout": 7200}
        workflows = (
            f"[{{ id = swarm, path = engine.workflows.ccwf.SwarmServerController, args = {json.dumps(server)} }}]"
        )
        server_components = "[]"
        controller = {
            "min_responses_required": point.clients,
            "wait_time_after_min_resps_received": 0,
            "learn_task_timeout": 3600,
            "learn_task_ack_timeout": 300,
            "final_result_ack_timeout": 600,
            "download_to_disk": point.download_to_disk,
        }
        executors = (
            f'[{{ tasks = ["train"], executor {{ {script} }} }}\n'
            f' {{ tasks = ["swarm_*"], executor {{ path = engine.executors.ccwf.SwarmClientController,'
            f" args = {json.dumps(controller)} }} }}]"
        )
        aggregator = "{ id = aggregator, path = engine.aggregators.DXOAggregator, args.expected_data_kind = WEIGHTS }"
        generator = "{ id = shareable_generator, path = engine.workflows.FullModelShareableGenerator }"
        client_components = f"[{persistor}\n {aggregator}\n {generator}]"
    else:
        args = {"num_clients": point.clients, "num_rounds": point.rounds, "download_to_disk": point.download_to_disk}
        server_components = f"[{persistor}]"
        robust = AGGREGATORS[point.aggregator]
        if robust is not None:
            args["aggregator_id"] = "robust"
            server_components = f"[{persistor}\n {json.dumps({'id': 'robust', **robust})}]"
        path = "engine.workflows.FedAvg"
        if point.workflow == "fedopt":
            path = "engine.workflows.FedOpt"
            args.update(FEDOPT_ARGS)
        workflows = f"[{{ id = fedavg, path = {path}, args = {json.dumps(args)} }}]"
        executors = f'[{{ tasks = ["*"], executor {{ {script} }} }}]'
        client_components = "[]"
    (folder / "app" / "config" / "config_fed_server.conf").write_text(
        f"format_version = 2\n{streaming}workflows = {workflows}\ncomponents = {server_components}\n", encoding="utf-8"
    )
    (folder / "app" / "config" / "config_fed_client.conf").write_text(
        f"format_version = 2\n{streaming}executors = {executors}\ncomponents = {client_components}\n",
        encoding="utf-8",
    )
    return folder


def round_delta(point: Point) -> float:
    """What one round adds to every parameter: client k adds ``k * 0.001`` with weight ``k * 100``.

    FedAvg (and clipping with a bound no update reaches): the weighted mean; the median and the
    trimmed mean: unweighted, over the clients' values; multi-Krum: the weighted mean of the
    ``num_selected`` clients in the middle (the ones nearest to the others).
    """
    ks = list(range(1, point.clients + 1))
    if point.aggregator == "median":
        return float(torch.tensor(ks, dtype=torch.float64).quantile(0.5)) * 0.001
    if point.aggregator == "trimmed":
        cut = int(AGGREGATORS["trimmed"]["args"]["trim_fraction"] * len(ks))  # type: ignore[index]
        kept = ks[cut : len(ks) - cut]
        return sum(kept) / len(kept) * 0.001
    if point.aggregator == "krum":
        selected = AGGREGATORS["krum"]["args"]["num_selected"]  # type: ignore[index]
        start = (len(ks) - selected) // 2
        ks = ks[start : start + selected]
    return sum(k * 0.001 * k * 100 for k in ks) / sum(k * 100 for k in ks)


def total_delta(point: Point) -> float:
    """What R rounds add to every parameter: ``R * D`` (D: `round_delta`), or FedOpt's Adam steps on D.

    FedOpt (Reddi et al.'s Adam, no bias correction, state from 0): every parameter sees the same
    pseudo-gradient D each round, so its steps follow a scalar recursion, computed here in float64.
    """
    d = round_delta(point)
    if point.workflow != "fedopt":
        return point.rounds * d
    lr, beta1, beta2, tau = (FEDOPT_ARGS[key] for key in ("server_lr", "beta1", "beta2", "epsilon"))
    m = v = total = 0.0
    for _ in range(point.rounds):
        m = beta1 * m + (1 - beta1) * d
        v = beta2 * v + (1 - beta2) * d * d
        total += lr * m / (v**0.5 + tau)
    return total


def check_model(path: Path, point: Point) -> tuple[bool, float]:
    """Whether every parameter equals ``init`` plus `total_delta` within 1e-6; and the largest error."""
    if not path.exists():
        return False, float("inf")
    worst = 0.0
    for _, got, expected in model_pairs(path, point):
        worst = max(worst, (got - expected).abs().max().item())
    return worst <= 1e-6, worst


def model_pairs(path: Path, point: Point) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Each parameter of the model file ``path`` as ``(name, got, expected)`` in float64, one at a
    time (little memory): expected is BenchNet's ``init`` plus `total_delta`."""
    delta = total_delta(point)
    with safe_open(str(path), framework="pt") as model:
        for index in range(benchnet.layer_count(point.size_mb)):
            for name, initial in zip(("weight", "bias"), benchnet.layer(index), strict=True):
                key = f"layers.{index}.{name}"
                yield key, model.get_tensor(key).double(), initial.double() + delta


def _sample(
    roots: list[int], downloads: Callable[[], list[Path]], peaks: Peaks, stop: threading.Event | None = None
) -> None:
    """Sample the process trees under ``roots`` every 50 ms (PSS every second) until they are gone or ``stop``."""
    cpu_started = time.thread_time()
    sites_of: dict[int, str] = {}
    roles_of: dict[int, str] = {}
    next_tree_s = next_pss_s = 0.0
    while any(is_alive(pid) for pid in roots) and not (stop is not None and stop.is_set()):
        started = time.monotonic()
        if started >= next_tree_s:
            sites_of, roles_of = {}, {}
            for root_pid in roots:
                tree = process_tree(root_pid)
                sites_of |= {pid: site for pid in tree if (site := _site_of(pid, tree)) is not None}
                roles_of |= {pid: "job" if "engine.runtime.entry" in tree[pid][1] else "script" for pid in tree}
            sites_of |= {pid: f"{DAEMON}{name}" for pid, name in peaks.daemons.items()}
            roles_of |= dict.fromkeys(peaks.daemons, "daemon")
            next_tree_s = started + TREE_INTERVAL_S
        with_pss = started >= next_pss_s
        if with_pss:
            next_pss_s = started + PSS_INTERVAL_S
        rss_sums: dict[str, float] = {}
        pss_sums: dict[str, float] = {}
        for pid, site in sites_of.items():
            rss = rss_mb(pid)
            rss_sums[site] = rss_sums.get(site, 0.0) + rss
            process = f"{site} {roles_of.get(pid, 'job')}"
            peaks.process_rss_mb[process] = max(peaks.process_rss_mb.get(process, 0.0), rss)
            if with_pss:
                pss_sums[site] = pss_sums.get(site, 0.0) + pss_mb(pid)
        for site, rss in rss_sums.items():
            peaks.rss_mb[site] = max(peaks.rss_mb.get(site, 0.0), rss)
        for site, pss in pss_sums.items():
            peaks.pss_mb[site] = max(peaks.pss_mb.get(site, 0.0), pss)
        peaks.tree_rss_mb = max(peaks.tree_rss_mb, sum(rss_sums.values()))
        on_disk = sum(_folder_mb(folder) for folder in downloads())
        peaks.download_dir_mb = max(peaks.download_dir_mb, on_disk)
        peaks.samples += 1
        time.sleep(max(0.0, started + SAMPLE_INTERVAL_S - time.monotonic()))
    peaks.sampler_cpu_s = time.thread_time() - cpu_started


def _site_of(pid: int, tree: dict[int, tuple[int, str]]) -> str | None:
    """The site a process belongs to: its own ``--site`` or its nearest ancestor's."""
    while pid in tree:
        parent, cmdline = tree[pid]
        if "engine.runtime.entry" in cmdline and "--site " in cmdline:
            return cmdline.split("--site ", 1)[1].split()[0]
        pid = parent
    return None


def _folder_mb(folder: Path) -> float:
    total = 0
    for path, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(path, name)).st_blocks * 512
            except OSError:
                pass
    return total / MIB


HEADER = (
    "| mode | workflow | security | model | clients | download_to_disk | chunk | server peak RSS | client peak RSS "
    "| tree peak RSS | disk peak | rounds (s) | whole run | correct |"
)


def markdown_table(runs: list[dict[str, Any]]) -> list[str]:
    """The runs as a markdown table (sizes in MB = 10^6 bytes, as BENCHMARK.md's figures)."""
    lines = [HEADER, "|" + "---|" * 14]
    lines.extend(_row(run) for run in runs)
    return lines


def _row(run: dict[str, Any]) -> str:
    def gb(mib: float) -> str:
        return f"{mib * MIB / 1e9:.2f} GB"

    rounds = " / ".join(f"{s:.1f}" for s in run["round_s"]) or "-"
    status = "yes" if run["correct"] else f"NO ({run['status']}, max error {run['max_abs_error']:.2e})"
    return (
        f"| {run.get('mode', 'sim')} | {run.get('workflow', 'fedavg')}{_aggregator(run)} "
        f"| {'insecure' if run.get('insecure') else 'CURVE'} "
        f"| {run['size_mb']} MiB | {run['clients']} "
        f"| {'on' if run['download_to_disk'] else 'off'} "
        f"| {run['chunk_mb']:g} MiB | {gb(run['server_peak_rss_mb'])} | {gb(run['client_peak_rss_mb'])} "
        f"| {gb(run['tree_peak_rss_mb'])} | {gb(run['download_dir_peak_mb'])} | {rounds} "
        f"| {run['seconds']:.1f} s | {status} |"
    )


def _aggregator(run: dict[str, Any]) -> str:
    aggregator = run.get("aggregator", "fedavg")
    client = run.get("client_script", "loop")
    mode = run.get("execution_mode", "in_process")
    return (
        ("" if aggregator == "fedavg" else f" ({aggregator})")
        + ("" if client == "loop" else f" [{client}]")
        + ("" if mode == "in_process" else f" [{mode}]")
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workflow",
        choices=["fedavg", "fedopt", "swarm"],
        nargs="+",
        default=["fedavg"],
        help="workflows (default fedavg; fedopt: FedOpt with Adam, see FEDOPT_ARGS)",
    )
    parser.add_argument("--size-mb", type=int, nargs="+", default=[1024], help="model sizes in MiB (default 1024)")
    parser.add_argument("--clients", type=int, nargs="+", default=[2], help="client counts (default 2)")
    parser.add_argument("--disk", choices=["on", "off"], nargs="+", default=["off", "on"], help="download_to_disk")
    parser.add_argument("--chunk-mb", type=float, nargs="+", default=[2.0], help="chunk sizes in MiB (0 = inline)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per run (default 2)")
    parser.add_argument(
        "--security", choices=["curve", "insecure"], nargs="+", default=["curve"],
        help="CURVE (default, as every job) or plain TCP (cell.insecure = true), to compare",
    )  # fmt: skip
    parser.add_argument(
        "--mode", choices=["sim", "poc"], nargs="+", default=["sim"],
        help="sim: flengine run (default); poc: production mode on this machine (daemons, flengine admin submit)",
    )  # fmt: skip
    parser.add_argument(
        "--aggregator", choices=sorted(AGGREGATORS), nargs="+", default=["fedavg"],
        help="FedAvg's aggregator: the weighted mean (default) or a robust one (see AGGREGATORS)",
    )  # fmt: skip
    parser.add_argument(
        "--client", choices=sorted(CLIENT_SCRIPTS), nargs="+", default=["loop"],
        help="client script: loop (BENCHMARK.md's, default) or module (trains BenchNet, flare.receive(into=net))",
    )  # fmt: skip
    parser.add_argument(
        "--execution-mode", choices=["in_process", "subprocess"], nargs="+", default=["in_process"],
        help="how the client script runs (default in_process)",
    )  # fmt: skip
    parser.add_argument("--out", help="write the JSON here (rewritten after every run)")
    parser.add_argument("--keep", action="store_true", help="keep each run's job and workspace")
    return parser


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
