"""What quantized transfers cost in accuracy: the digits job (jobs/fedavg) with and without `Quantize`.

    python tools/bench_quantize_accuracy.py [--job jobs/fedavg] [--modes none fp16 bf16 int8] [--out FILE]

For each mode it copies the job to a temporary folder, adds ``engine.filters.Quantize`` with that
mode to the server's ``task_data_filters`` and the clients' ``task_result_filters`` (``none``:
the job as it is), runs it with ``flengine run`` as a user would, and reads the last round's
metrics from ``summary.json``. The digits job is seeded, so the runs differ by the quantization
alone. Prints a table (accuracy, and its difference from ``none`` in points) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def quantized_job(job: Path, folder: Path, mode: str) -> Path:
    """A copy of ``job`` in ``folder`` whose models travel quantized with ``mode`` (``none``: unchanged)."""
    copy = folder / "job"
    shutil.copytree(job, copy)
    if mode != "none":
        entry = f"[{{ tasks = [train], filters = [{{ path = engine.filters.Quantize, args {{ mode = {mode} }} }}] }}]"
        for config, key in (
            ("config_fed_server.conf", "task_data_filters"),
            ("config_fed_client.conf", "task_result_filters"),
        ):
            path = copy / "app" / "config" / config
            path.write_text(path.read_text() + f"\n{key} = {entry}\n")
    return copy


def run(job: Path, mode: str) -> dict:
    """Run the job with ``mode``; the last round's metrics and the run's status."""
    with tempfile.TemporaryDirectory(prefix="flengine-quantize-") as scratch:
        folder = Path(scratch)
        copy = quantized_job(job, folder, mode)
        workspace = folder / "workspace"
        done = subprocess.run(
            [sys.executable, "-m", "engine", "run", str(copy), "--workspace", str(workspace), "--quiet"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        summary = json.loads((workspace / "summary.json").read_text())
        if done.returncode != 0:
            raise RuntimeError(f"{mode}: the job failed ({summary.get('reason')}):\n{done.stdout[-2000:]}")
        return {"mode": mode, "status": summary["status"], "metrics": summary["rounds"][-1]["metrics"]}


def main(argv: list[str] | None = None) -> int:
    """Run every mode; print the table; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, default=REPO / "jobs" / "fedavg")
    parser.add_argument("--modes", nargs="+", default=["none", "fp16", "bf16", "int8", "int4"])
    parser.add_argument("--metric", default="global_accuracy")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    runs = [run(args.job.resolve(), mode) for mode in args.modes]
    base = runs[0]["metrics"][args.metric]
    print(f"| mode | {args.metric} | vs {runs[0]['mode']} (points) |")
    print("|---|---|---|")
    for entry in runs:
        value = entry["metrics"][args.metric]
        print(f"| {entry['mode']} | {value:.4f} | {100 * (value - base):+.2f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"job": str(args.job), "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
