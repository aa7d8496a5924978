"""Rounds each algorithm's digits job needs to reach FedAvg's accuracy (the figures of docs/algorithms.md).

Runs copies of the jobs under jobs/ (FedAvg, FedProx, FedOpt, SCAFFOLD by default) with
``num_rounds`` set to R + 1, each several times (the server's starting model is not seeded, so
runs differ), and reads the accuracy of the global model after round r from round r + 1's
``global_accuracy`` (every site validates the model it received on the validation set all sites
share, so their mean is that model's accuracy). The target is FedAvg's mean accuracy after its
job's own number of rounds (3).

    python tools/bench_algorithms.py --rounds 6 --repeat 3 --out algorithms.json
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.runtime.simulator import run_simulation  # noqa: E402
from engine.runtime.states import JobState  # noqa: E402

JOBS = ("fedavg", "fedprox", "fedopt", "scaffold")
TARGET_ROUNDS = 3  # the rounds jobs/fedavg runs


def accuracies(job: str, rounds: int, scratch: Path) -> list[float]:
    """The global model's accuracy after rounds 1..``rounds`` of one run of ``jobs/<job>``."""
    folder = shutil.copytree(ROOT / "jobs" / job, scratch / job, ignore=shutil.ignore_patterns("__pycache__"))
    server = folder / "app" / "config" / "config_fed_server.conf"
    text, count = re.subn(r"num_rounds = \d+", f"num_rounds = {rounds + 1}", server.read_text(encoding="utf-8"))
    if count != 1:
        raise SystemExit(f"{server}: expected one num_rounds, found {count}")
    server.write_text(text, encoding="utf-8")
    result = run_simulation(folder, None, scratch / f"{job}-workspace", out=io.StringIO())
    if result.state is not JobState.FINISHED_COMPLETED:
        raise SystemExit(f"jobs/{job}: {result.state.value} {result.summary.get('reason')}")
    # Round r + 1's global_accuracy is the accuracy of the model round r made.
    return [entry["metrics"]["global_accuracy"] for entry in result.summary["rounds"][1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", nargs="+", default=list(JOBS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[list[float]]] = {}
    for _ in range(args.repeat):
        for job in args.jobs:
            with tempfile.TemporaryDirectory(prefix=f"bench-{job}-") as scratch:
                runs.setdefault(job, []).append(accuracies(job, args.rounds, Path(scratch)))
    means = {job: [statistics.mean(r[i] for r in results) for i in range(args.rounds)] for job, results in runs.items()}
    target = means["fedavg"][TARGET_ROUNDS - 1] if "fedavg" in means else None
    report: dict[str, Any] = {"rounds": args.rounds, "repeat": args.repeat, "target": target, "jobs": {}}
    print(f"mean accuracy of the global model after each round ({args.repeat} runs each)")
    print("job        " + " ".join(f"{r:>6}" for r in range(1, args.rounds + 1)) + "  rounds to target")
    for job, mean in means.items():
        reached = next((r + 1 for r, value in enumerate(mean) if target is not None and value >= target), None)
        report["jobs"][job] = {"mean": mean, "runs": runs[job], "rounds_to_target": reached}
        shown = reached if reached is not None else f"> {args.rounds}"
        print(f"{job:<10} " + " ".join(f"{v:6.3f}" for v in mean) + f"  {shown}")
    if target is not None:
        print(f"target: FedAvg's mean accuracy after {TARGET_ROUNDS} rounds, {target:.4f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
