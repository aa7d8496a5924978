"""Where the server's handler threads spend a FedAvg round: working, waiting for the fold's locks, or for the network.

    pip install py-spy==0.4.0
    python tools/profile_round.py [--size-mb 512] [--clients 4] [--rounds 2] [--rate 100] [--out FILE]

Runs ``tools/bench.py`` (BenchNet, memory mode: results folded chunk by chunk) and attaches
py-spy to the job's server process (``--idle --threads --nonblocking``: every thread, waiting or
not, sampled without pausing the process). The samples of the threads that take results (their
stack holds the result intake's ``_take_result``) are sorted by their innermost frame:

- **lock wait**: a line of ``engine/aggregators`` that takes a lock (``with self._lock``,
  ``acquire()``) or waits for another thread (``.wait(``), or `StripedAdds.drain`;
- **network**: a wait for a chunk (in ``threading`` or ``queue``, or a line that calls ``.wait(`` or
  ``.get(timeout``);
- **active**: anything else (decoding, checking, adding, bookkeeping).

It prints the shares and the top innermost frames of each kind, and writes JSON. The issue's
goal: lock waits under 10% of the handler threads' active samples (lock wait / (lock wait +
active)).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: A line of source that waits for a lock.
_LOCK_LINE = re.compile(r"with self\._lock\b|\.acquire\(|with lock\b|with self\._drained\b|\.wait\(")
#: A line of source that blocks until something arrives (``SimpleQueue.get`` and ``Event.wait`` are
#: C calls: py-spy shows the Python line that made them).
_WAIT_LINE = re.compile(r"\.wait\(|\.get\(timeout|\.get\(\)|\.poll\(|\.recv")
_FRAME = re.compile(r"^(?P<function>.+) \((?P<file>[^()]+):(?P<line>\d+)\)$")
_STANDARD_WAITS = ("threading.py", "queue.py", "selectors.py")


def server_pid(timeout_s: float) -> int:
    """The pid of the job's server process (``engine.runtime.entry server``), once it runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            text = b" ".join(words)
            if b"engine.runtime.entry" in text and b" server" in text:
                return int(entry.name)
        time.sleep(0.05)
    raise TimeoutError("no server process appeared")


def source_line(file: str, line: int, cache: dict[str, list[str]]) -> str:
    """The text of ``file:line`` (a path as py-spy prints it, looked for under the repository)."""
    if file not in cache:
        path = Path(file) if Path(file).is_absolute() else REPO / file
        if not path.exists():
            found = list((REPO / "engine").rglob(Path(file).name))
            path = found[0] if len(found) == 1 else path
        try:
            cache[file] = path.read_text().splitlines()
        except OSError:
            cache[file] = []
    lines = cache[file]
    return lines[line - 1] if 0 < line <= len(lines) else ""


def classify(stack: list[str], cache: dict[str, list[str]]) -> tuple[str, str]:
    """(kind, innermost frame) of one sample of a handler thread."""
    leaf = stack[-1]
    if any(frame.startswith("drain (") and "striped_adds" in frame for frame in stack):
        return "lock wait", leaf
    match = _FRAME.match(leaf)
    if match is not None:
        file, line = match["file"], int(match["line"])
        if "aggregators" in file or Path(file).name in ("folding.py", "striped_adds.py"):
            if _LOCK_LINE.search(source_line(file, line, cache)):
                return "lock wait", leaf
        if Path(file).name in _STANDARD_WAITS or _WAIT_LINE.search(source_line(file, line, cache)):
            return "network", leaf
    return "active", leaf


def analyse(raw: Path) -> dict:
    """Shares of the handler threads' samples, from py-spy's raw output."""
    counts: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    cache: dict[str, list[str]] = {}
    for text in raw.read_text().splitlines():
        stack_text, _, number = text.rpartition(" ")
        frames = stack_text.split(";")[1:]  # the first element names the thread
        if not frames or not any(frame.startswith("_take_result (") for frame in frames):
            continue
        kind, leaf = classify(frames, cache)
        counts[kind] += int(number)
        leaves[kind][leaf] += int(number)
    working = counts["active"] + counts["lock wait"]
    return {
        "samples": dict(counts),
        "lock_wait_share_of_active": round(counts["lock wait"] / working, 4) if working else None,
        "top": {kind: leaves[kind].most_common(8) for kind in leaves},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the round under py-spy; print and write the analysis."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=int, default=100, help="samples per second")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy")
    if spy is None:
        parser.error("py-spy is not installed: pip install py-spy==0.4.0")
    with tempfile.TemporaryDirectory(prefix="flengine-profile-") as scratch:
        raw = Path(scratch) / "raw.txt"
        bench = subprocess.Popen(
            [sys.executable, str(REPO / "tools" / "bench.py"), "--size-mb", str(args.size_mb), "--clients",
             str(args.clients), "--disk", "off", "--rounds", str(args.rounds)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            pid = server_pid(300)
            recorder = subprocess.run(
                [spy, "record", "--pid", str(pid), "--idle", "--threads", "--nonblocking", "--format", "raw",
                 "--rate", str(args.rate), "-o", str(raw)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            output, _ = bench.communicate(timeout=1800)
        finally:
            if bench.poll() is None:
                bench.kill()
        if not raw.exists():
            raise RuntimeError(f"py-spy wrote nothing: {recorder.stderr[-2000:]}")
        result = {"size_mb": args.size_mb, "clients": args.clients, "rounds": args.rounds, **analyse(raw)}
    print(output.strip().splitlines()[-1] if output.strip() else "(bench printed nothing)")
    print(json.dumps({key: result[key] for key in ("samples", "lock_wait_share_of_active")}))
    for kind, top in result["top"].items():
        print(f"{kind}:")
        for leaf, count in top:
            print(f"  {count:6d}  {leaf}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
