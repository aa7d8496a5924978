"""The fault table of docs/reliability.md, measured by running the fault suite (tests/faults/).

Each fault test records what the job did about its fault (``fault_figures``): the outcome, the
seconds from the fault (or from the restart, for a resume) until the job trained normally again,
the rounds lost, whether the final model was exact, and the leftovers (every test asserts none:
no temp file, no download folder, no process). This tool runs the suite with those records on
and prints them as one Markdown table.

Command line::

    python tools/fault_table.py [--repeat N] [--out FILE.json] [-k EXPRESSION]

``--repeat`` runs the suite N times and gives each time as the median (with the range).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_suite(expression: str | None) -> list[dict]:
    """Run tests/faults once (slow tests too); return the rows its tests recorded."""
    with tempfile.TemporaryDirectory(prefix="fault-table-") as folder:
        figures = Path(folder) / "figures.jsonl"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "tests/faults",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "slow or not slow",
        ]
        if expression:
            command += ["-k", expression]
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, "FLENGINE_FAULT_FIGURES": str(figures)})
        if done.returncode != 0:
            print(
                f"warning: the fault suite exited with {done.returncode}; failed tests record nothing", file=sys.stderr
            )
        if not figures.exists():
            return []
        return [json.loads(line) for line in figures.read_text(encoding="utf-8").splitlines()]


def merge(runs: list[list[dict]]) -> list[dict]:
    """One row per fault: the times of every run (median and range), the rest from the first run."""
    rows: dict[str, dict] = {}
    for run in runs:
        for row in run:
            entry = rows.setdefault(row["fault"], {**row, "recover_runs": []})
            if row["recover_s"] is not None:
                entry["recover_runs"].append(row["recover_s"])
    return list(rows.values())


def table(rows: list[dict]) -> list[str]:
    """The Markdown lines of the table."""
    lines = [
        "| Fault | What the job did | Time to recover (s) | Rounds lost | Model exact | Leftovers |",
        "|---|---|---:|---:|---|---|",
    ]
    for row in rows:
        times = row["recover_runs"]
        if not times:
            recover = "—"
        elif len(times) == 1:
            recover = f"{times[0]:.2f}"
        else:
            recover = f"{statistics.median(times):.2f} ({min(times):.2f}–{max(times):.2f})"
        lost = "—" if row["rounds_lost"] is None else str(row["rounds_lost"])
        exact = {True: "yes (1e-6)", False: "no", None: "—"}[row["exact"]]
        lines.append(f"| {row['fault']} | {row['outcome']} | {recover} | {lost} | {exact} | {row['leftovers']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of the suite (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("-k", dest="expression", default=None, help="only the fault tests matching this pytest -k")
    args = parser.parse_args(argv)
    rows = merge([run_suite(args.expression) for _ in range(max(1, args.repeat))])
    print("\n".join(table(rows)))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
