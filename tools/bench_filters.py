"""Benchmark of the privacy filters: seconds per GiB of update and the memory they add to the model's.

    python tools/bench_filters.py --size-mb 256 1024 [--filters gaussian percentile] [--repeat 3]
        [--threads N] [--out FILE]

For each filter and size it starts a fresh Python process that builds a weight difference of that
many MiB (float32 tensors of 1..16 MiB, like a model's layers, plus a few small ones), wraps it in
an FLModel of params_type DIFF, runs the filter ``--repeat`` times on it (in place, as on a client)
and reports: the best and the median seconds, seconds per GiB (from the best), and the peak RSS
increase over the process's RSS with the model built and the filter warmed up on a tiny update
(imports such as dp_accounting's scipy are not counted): ``ru_maxrss`` after minus RSS before, what
the filter allocates beyond the model. A fresh process per point keeps one point's peak out of the
next. Prints a markdown table and writes JSON to ``--out``.

``--threads 1`` is what the filter gets in a job whose training script calls
``torch.set_num_threads(1)`` in process (as the digits example does); torch's default is one
thread per core, which on a busy machine can be several times slower for these elementwise passes.

``gaussian`` is `engine.filters.GaussianPrivacy` (clip_norm 1, noise_multiplier 1, a seed; its
epsilon computation, a few ms, is included); ``percentile`` is `engine.filters.PercentilePrivacy`
(percentile 10, gamma 0.01).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
REPO = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _state_dict(size_mb: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(0)
    params, left, i = {}, size_mb * MIB // 4, 0
    sizes = [4 * MIB, 2 * MIB, 1 * MIB, MIB // 4]  # elements: 16, 8, 4, 1 MiB of float32
    while left > 0:
        n = min(sizes[i % len(sizes)], left)
        params[f"layer{i}.weight"] = torch.empty(n).normal_(0, 0.01, generator=generator)
        params[f"layer{i}.bias"] = torch.empty(64).normal_(0, 0.01, generator=generator)
        left -= n
        i += 1
    return params


def measure(filter_name: str, size_mb: int, repeat: int, threads: int) -> dict:
    """Run in the child process: build the update, time the filter, report peak RSS over the model's."""
    sys.path.insert(0, str(REPO))
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    from engine.filters import GaussianPrivacy, PercentilePrivacy
    from engine.model import FLModel, ParamsType, ReservedHeaderKey, shareable_from_model

    params = _state_dict(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    if filter_name == "gaussian":
        make = lambda: GaussianPrivacy(clip_norm=1.0, noise_multiplier=1.0, seed=0)  # noqa: E731
    else:
        make = lambda: PercentilePrivacy(percentile=10, gamma=0.01)  # noqa: E731
    # Warm up on a small update first: the imports (dp_accounting brings scipy) and first-use
    # allocations are the process's, not the filter's per-GiB cost.
    warm = {"w": torch.zeros(1024)}
    make().process(shareable_from_model(FLModel(params=warm, params_type=ParamsType.DIFF)), "bench")
    times = []
    rss_before = _rss_bytes()
    for i in range(repeat):
        shareable = shareable_from_model(FLModel(params=params, params_type=ParamsType.DIFF))
        shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, i)
        filt = make()
        started = time.perf_counter()
        filt.process(shareable, "bench")
        times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    best = min(times)
    return {
        "filter": filter_name,
        "size_mb": size_mb,
        "update_bytes": nbytes,
        "tensors": len(params),
        "best_s": round(best, 4),
        "median_s": round(statistics.median(times), 4),
        "s_per_gib": round(best / (nbytes / 2**30), 3),
        "rss_model_mb": round(rss_before / MIB, 1),
        "peak_rss_increase_mb": round(max(0, peak - rss_before) / MIB, 1),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--filters", nargs="+", choices=["gaussian", "percentile"], default=["gaussian", "percentile"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=4, metavar=("FILTER", "SIZE_MB", "REPEAT", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), int(args.child[2]), int(args.child[3]))))
        return
    runs = []
    for filter_name in args.filters:
        for size_mb in args.size_mb:
            child = [
                sys.executable,
                __file__,
                "--child",
                filter_name,
                str(size_mb),
                str(args.repeat),
                str(args.threads),
            ]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    columns = ["filter", "update (MiB)", "threads", "best (s)", "median (s)", "s/GiB", "model RSS (MiB)"]
    print("| " + " | ".join([*columns, "peak RSS increase (MiB)"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['filter']} | {r['size_mb']} | {r['torch_threads']} | {r['best_s']} | {r['median_s']} "
            f"| {r['s_per_gib']} | {r['rss_model_mb']} | {r['peak_rss_increase_mb']} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"runs": runs}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
