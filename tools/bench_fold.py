"""Microbenchmark of the server's fold: R results of S MiB folded chunk by chunk by 1 and by T threads.

    python tools/bench_fold.py [--size-mb 512] [--results 4] [--threads 1 2] [--chunk-mb 2] [--repeats 3]
        [--torch-threads 1] [--check one-pass|before|raw] [--out FILE]

It drives `engine.aggregators.folding.FoldingModelAggregator` as the server's handler threads do:
each result is opened with its weight and the workflow's check (finite, `check_finite`), its
chunks are folded (`ResultFold.fold_piece`: each block checked, then added) in the thread that
"pulls" it, then committed; the threads fold different results at once. ``--check before``
checks each whole chunk first and folds it unchecked (two passes over the chunk: how the server
did it before the check moved into the add). ``--check raw`` is the baseline of the same run:
the same chunks added into one sum with plain ``torch.add_``, no check, no lock, no engine (what
the host's memory allows). The sum is allocated and touched once before timing (a warm-up
round), so what is timed is the folding. Each point runs ``--repeats`` times; the median is kept.
``--torch-threads`` sets torch's intra-op threads (1: each fold thread is one core's worth, the
case of a server whose cores are all busy pulling). The mean is checked against its closed form.
Prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.aggregators.check import check_finite  # noqa: E402
from engine.aggregators.folding import FoldingModelAggregator  # noqa: E402
from engine.model import FLModel  # noqa: E402


def fold_round(
    aggregator: FoldingModelAggregator, results: list[torch.Tensor], threads: int, chunk: int, check: str
) -> float:
    """Fold ``results`` with ``threads`` threads; return the seconds it took."""
    numel = results[0].numel()

    def fold_one(index: int) -> None:
        site = f"site-{index + 1}"

        def check_tensor(name: str, values: torch.Tensor) -> None:  # the workflow's rules
            check_finite({name: values}, site)

        model = FLModel(meta={"NUM_STEPS_CURRENT_ROUND": index + 1})
        fold = aggregator.open_result(model, site, check_tensor=check_tensor if check == "one-pass" else None)
        fold.check_layout({"w": ((numel,), torch.float32)})
        flat = results[index]
        for start in range(0, numel, chunk):
            piece = flat[start : start + chunk]
            if check == "before":
                check_tensor("w", piece)
            fold.fold_piece("w", start, piece)
        fold.complete("w")
        placeholder = {"w": torch.empty(numel, device="meta")}
        aggregator.accept_model(FLModel(params=placeholder, meta={"NUM_STEPS_CURRENT_ROUND": index + 1}), site)

    total = torch.zeros(numel) if check == "raw" else None

    def add_raw(index: int) -> None:  # racy on purpose: only the memory traffic counts
        for start in range(0, numel, chunk):
            total[start : start + chunk].add_(results[index][start : start + chunk], alpha=0.5)

    def worker(first: int) -> None:
        for index in range(first, len(results), threads):
            (add_raw if check == "raw" else fold_one)(index)

    started = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return time.perf_counter() - started


def run_point(size_mb: int, count: int, threads: int, chunk_mb: float, repeats: int, check: str) -> dict:
    """Median seconds and GiB/s of folding ``count`` results of ``size_mb`` MiB with ``threads`` threads."""
    numel = size_mb * 2**20 // 4
    chunk = int(chunk_mb * 2**20) // 4
    results = [torch.full((numel,), float(k + 1)) for k in range(count)]
    expected = sum((k + 1) * (k + 1) for k in range(count)) / sum(k + 1 for k in range(count))
    seconds = []
    for repeat in range(repeats + 1):  # the first round allocates and touches the sum: not timed
        aggregator = FoldingModelAggregator()
        elapsed = fold_round(aggregator, results, threads, chunk, check)
        if check != "raw":
            mean = aggregator.aggregate_model().params["w"]
            if abs(float(mean[0]) - expected) > 1e-5 or abs(float(mean[-1]) - expected) > 1e-5:
                raise AssertionError(f"wrong mean {float(mean[0])}, expected {expected}")
            del mean
        del aggregator
        if repeat:
            seconds.append(elapsed)
    median = statistics.median(seconds)
    return {
        "size_mb": size_mb,
        "results": count,
        "threads": threads,
        "check": check,
        "seconds": [round(s, 3) for s in seconds],
        "median_s": round(median, 3),
        "gib_per_s": round(count * size_mb / 1024 / median, 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the points; print the table; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--results", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunk-mb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--check", choices=["one-pass", "before", "raw"], nargs="+", default=["one-pass", "raw"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    runs = [
        run_point(args.size_mb, args.results, t, args.chunk_mb, args.repeats, check)
        for check in args.check
        for t in args.threads
    ]
    base = runs[0]["median_s"]
    print(f"| check | fold threads | median (s) | GiB/s | vs first row | torch threads {args.torch_threads} |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        speedup = base / run["median_s"]
        print(
            f"| {run['check']} | {run['threads']} | {run['median_s']:.3f} | {run['gib_per_s']:.2f} | {speedup:.2f}x | |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"torch_threads": args.torch_threads, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
