"""Accuracy of the digits job with one lying site out of five, per aggregator: what each one defends.

    python tools/bench_robust.py [--rounds 5] [--attacks none scale flip nan] [--out FILE]

For each aggregator (weighted FedAvg, norm clipping, coordinate-wise median, trimmed mean,
multi-Krum) and each attack of ``tools/liars/liar_train.py`` (``none``: five honest sites;
``scale``: site-5 sends its update times 10; ``flip``: minus 10 times its update; ``nan``: a NaN
weight) it writes the job with `tools.liars.job.make_liar_job` (every job starts from the same
seeded weights; one local epoch per round; the honest sites' data are the same in every run),
runs it with the simulator, and reads the global model's accuracy on the shared validation set
after each round (the ``global_accuracy`` the honest sites report at the start of the next
round, and the final model's, computed here). Prints a markdown table: the final accuracy, the
first round whose global model reaches ``--target``, and the results refused; ``--out`` writes
the JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.examples.digits import Net, load_split  # noqa: E402
from engine.runtime.simulator import run_simulation  # noqa: E402
from tools.liars.job import make_liar_job  # noqa: E402

CLIENTS = 5
LIAR = "site-5"
#: The aggregators compared, as the component a job would name (None: FedAvg's weighted mean).
AGGREGATORS: dict[str, dict[str, Any] | None] = {
    "fedavg": None,
    "clip (max_norm 2)": {"path": "engine.aggregators.NormClippingAggregator", "args": {"max_norm": 2.0}},
    "clip (max_norm 0.5)": {"path": "engine.aggregators.NormClippingAggregator", "args": {"max_norm": 0.5}},
    "median": {"path": "engine.aggregators.CoordinateMedianAggregator", "args": {}},
    "trimmed mean (0.2)": {"path": "engine.aggregators.TrimmedMeanAggregator", "args": {"trim_fraction": 0.2}},
    "multi-Krum (f=1, m=3)": {
        "path": "engine.aggregators.KrumAggregator",
        "args": {"num_byzantine": 1, "num_selected": 3},
    },
}


def accuracy_of(model_file: Path) -> float:
    """The model's accuracy on the digits validation set every site shares."""
    _, (val_x, val_y) = load_split(0, CLIENTS)
    net = Net(hidden=64)
    net.load_state_dict(load_file(model_file))
    net.eval()
    with torch.no_grad():
        return (net(val_x).argmax(dim=1) == val_y).float().mean().item()


def run_one(root: Path, aggregator: str, attack: str, rounds: int, target: float) -> dict[str, Any]:
    """Run the job with ``attack`` at site-5 (none: all honest) and ``aggregator``; return its record."""
    liars = {} if attack == "none" else {LIAR: attack}
    folder = root / f"{len(list(root.iterdir()))}"
    job = make_liar_job(
        folder / "job",
        num_clients=CLIENTS,
        liars=liars,
        num_rounds=rounds,
        min_clients=CLIENTS - 1,
        aggregator=AGGREGATORS[aggregator],
    )
    started = time.monotonic()
    result = run_simulation(job, CLIENTS, folder / "workspace", out=io.StringIO())
    seconds = time.monotonic() - started
    summary = json.loads((folder / "workspace" / "summary.json").read_text(encoding="utf-8"))
    model_file = folder / "workspace" / "server" / "models" / "global.safetensors"
    final = accuracy_of(model_file) if model_file.exists() else None
    # global_accuracy of round r is the accuracy of round r-1's global model (round 0: the initial one)
    curve = [entry.get("metrics", {}).get("global_accuracy") for entry in summary["rounds"]][1:] + [final]
    reached = next((i + 1 for i, value in enumerate(curve) if value is not None and value >= target), None)
    return {
        "aggregator": aggregator,
        "attack": attack,
        "status": result.state.value,
        "final_accuracy": final,
        "accuracy_per_round": curve,
        "round_reaching_target": reached,
        "refused": summary.get("refused", {}),
        "seconds": round(seconds, 1),
    }


def markdown(records: list[dict[str, Any]], attacks: list[str], target: float) -> list[str]:
    """Rows: aggregators; columns: attacks; cells: final accuracy (round reaching the target)."""
    lines = [
        f"| aggregator | {' | '.join(attacks)} |",
        "|---|" + "---|" * len(attacks),
    ]
    for aggregator in AGGREGATORS:
        cells = []
        for attack in attacks:
            record = next((r for r in records if r["aggregator"] == aggregator and r["attack"] == attack), None)
            if record is None:
                cells.append("-")
            elif record["final_accuracy"] is None:
                cells.append(record["status"])
            else:
                reached = record["round_reaching_target"]
                cells.append(f"{record['final_accuracy']:.3f} ({f'round {reached}' if reached else 'never'})")
        lines.append(f"| {aggregator} | {' | '.join(cells)} |")
    lines.append(f"\nCells: final accuracy (first round whose model reaches {target:.0%}).")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--attacks", nargs="+", default=["none", "scale", "flip", "nan"])
    parser.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS), choices=list(AGGREGATORS))
    parser.add_argument("--target", type=float, default=0.85, help="the accuracy 'rounds to' counts to")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    records = []
    with tempfile.TemporaryDirectory(prefix="flengine-robust-") as temp:
        for aggregator in args.aggregators:
            for attack in args.attacks:
                record = run_one(Path(temp), aggregator, attack, args.rounds, args.target)
                records.append(record)
                print(json.dumps(record), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": records}, indent=2) + "\n", encoding="utf-8")
    print("\n".join(markdown(records, args.attacks, args.target)))
    return 0 if all(r["status"] == "FINISHED_COMPLETED" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
