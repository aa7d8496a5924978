"""Benchmark of simulation at scale: ``flengine run -n N -t W`` with virtual clients, measured from outside.

    python tools/bench_scale.py --clients 100 1000 10000 --workers 2 4 [--backend processes ray]
        [--processes 100] [--rounds 5] [--sampled 10] [--out FILE]

The job is jobs/fedavg (the digits MLP, the README's example script, unchanged) with ``sampled``
clients a round and ``rounds`` rounds, written to a temporary folder. Each point runs
``flengine run`` as a user would, as its own process, and samples every 100 ms from outside the
RSS of every process of its tree (the CLI, the launcher, the server, the workers or client
processes, and Ray's own processes with ``--backend ray``), and their PSS once a second; the
peak of the sum of PSS is "total memory" (RSS counts the pages that forked processes share once
in each of them; PSS divides them among the sharers), the peak of the sum of RSS is kept too.
From the run's summary.json it takes the seconds of each round, the start-up time (from the
command's start to the first round, as the summary's timings count it) and the final global
accuracy. ``--processes N`` adds the same job with one process per client (no
``-t``) for comparison. Prints a markdown table and writes JSON (``{"runs": [...]}``) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proc_tree import is_alive, process_tree, pss_mb, rss_mb  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLE_INTERVAL_S = 0.1
TREE_INTERVAL_S = 0.5
#: PSS walks each process's address space: read once a second.
PSS_INTERVAL_S = 1.0


def write_job(folder: Path, sampled: int, rounds: int) -> Path:
    """jobs/fedavg with ``sampled`` clients a round and ``rounds`` rounds."""
    job = folder / "fedavg_scale"
    shutil.copytree(REPO / "jobs" / "fedavg", job)
    server = job / "app" / "config" / "config_fed_server.conf"
    text = server.read_text(encoding="utf-8")
    text = text.replace("num_clients = 2", f"num_clients = {sampled}\n      sample_seed = 1")
    server.write_text(text.replace("num_rounds = 3", f"num_rounds = {rounds}"), encoding="utf-8")
    return job


def run_point(job: Path, clients: int, workers: int | None, backend: str, folder: Path) -> dict[str, Any]:
    """Run one point; return its figures."""
    workspace = folder / f"ws-{clients}-{workers}-{backend}"
    command = ["flengine", "run", str(job), "-n", str(clients), "--workspace", str(workspace), "-q"]
    if workers is not None:
        command += ["-t", str(workers), "--backend", backend]
    peak = {"rss_mb": 0.0, "pss_mb": 0.0}
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = threading.Thread(target=_sample, args=(process.pid, peak), daemon=True)
    sampler.start()
    output, _ = process.communicate()
    wall_s = time.monotonic() - started
    sampler.join(5.0)
    summary = json.loads((workspace / "summary.json").read_text(encoding="utf-8"))
    rounds = [r["time_s"] for r in summary["rounds"]]
    accuracy = summary["rounds"][-1]["metrics"].get("global_accuracy") if summary["rounds"] else None
    record = {
        "clients": clients,
        "workers": workers,
        "backend": backend if workers is not None else "processes (no -t)",
        "status": summary["status"],
        "total_peak_pss_mb": round(peak["pss_mb"], 1),
        "total_peak_rss_mb": round(peak["rss_mb"], 1),
        "round_s": rounds,
        "round_median_s": round(statistics.median(rounds), 3) if rounds else None,
        "round_mean_s": round(statistics.fmean(rounds), 3) if rounds else None,
        "startup_s": summary["timings"]["stages"].get("first_round_started"),
        "wall_s": round(wall_s, 2),
        "final_accuracy": accuracy,
    }
    if summary["status"] != "FINISHED_COMPLETED":
        record["output_tail"] = output[-2000:]
    shutil.rmtree(workspace, ignore_errors=True)
    return record


def _sample(root: int, peak: dict[str, float]) -> None:
    """Sum the RSS (and the PSS) of ``root``'s tree every `SAMPLE_INTERVAL_S` until it ends; keep the peaks."""
    pids: list[int] = [root]
    next_tree_s = next_pss_s = 0.0
    while is_alive(root):
        now = time.monotonic()
        if now >= next_tree_s:
            pids = list(process_tree(root))
            next_tree_s = now + TREE_INTERVAL_S
        peak["rss_mb"] = max(peak["rss_mb"], sum(rss_mb(pid) for pid in pids))
        if now >= next_pss_s:
            peak["pss_mb"] = max(peak["pss_mb"], sum(pss_mb(pid) for pid in pids))
            next_pss_s = now + PSS_INTERVAL_S
        time.sleep(max(0.0, now + SAMPLE_INTERVAL_S - time.monotonic()))


HEADER = (
    "| clients | workers | backend | total memory (PSS), peak | total RSS, peak | round (s), median | rounds (s) "
    "| start-up (s) | accuracy |"
)


def markdown_table(runs: list[dict[str, Any]]) -> list[str]:
    """The table of docs/performance.md's "Simulation at scale"."""
    lines = [HEADER, "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        rounds = " / ".join(f"{s:.2f}" for s in run["round_s"])
        accuracy = "-" if run["final_accuracy"] is None else f"{run['final_accuracy']:.3f}"
        lines.append(
            f"| {run['clients']:,} | {run['workers'] or '-'} | {run['backend']} "
            f"| {run['total_peak_pss_mb'] / 1024:.2f} GiB | {run['total_peak_rss_mb'] / 1024:.2f} GiB "
            f"| {run['round_median_s']:.2f} | {rounds} "
            f"| {run['startup_s']:.1f} | {accuracy} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the matrix; print the table; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", nargs="+", choices=["processes", "ray"], default=["processes"])
    parser.add_argument("--processes", type=int, nargs="*", default=[], help="client counts to run without -t")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sampled", type=int, default=10, help="clients sampled a round")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as temporary:
        folder = Path(temporary)
        job = write_job(folder, args.sampled, args.rounds)
        points = [(n, None, "processes") for n in args.processes]
        points += [(n, w, b) for b in args.backend for w in args.workers for n in args.clients]
        for clients, workers, backend in points:
            record = run_point(job, clients, workers, backend, folder)
            print(json.dumps(record), flush=True)
            runs.append(record)
    print("\n".join(markdown_table(runs)))
    if args.out is not None:
        args.out.write_text(json.dumps({"runs": runs}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
