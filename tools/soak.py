"""Soak test: one small-model job for many rounds, every process's RSS, fds and threads each round.

    python tools/soak.py [--mode sim|poc|both] [--rounds 200] [--clients 2] [--job PATH] [--out FILE] [--keep]

It copies a FedAvg job (default ``jobs/fedavg``: the digits MLP, about 0.05 s a round here) into a
temp folder with ``num_rounds`` (and the workflow's ``num_clients`` and the job's ``min_clients``)
set, and runs it with ``flengine run`` (``sim``) and/or (default: both) in POC mode (``poc``: ``flengine poc
prepare`` / ``start``, ``flengine admin ... submit``, ``flengine poc stop``). Each time the job's
server writes ``round_started`` to its ``events.jsonl`` (polled every 10 ms) it samples, from
outside, every process whose command line names the run's temp folder (the simulator, its
launcher, the job's server and sites; in POC mode the server and site daemons too, which outlive
the job): VmRSS from ``/proc/PID/status``, the entries of ``/proc/PID/fd`` and of
``/proc/PID/task``. The sample taken as round r+1 starts is the state after round r, every
process idle and up; so the job runs one round more than ``--rounds`` (a sample at the last
``round_done`` would catch the sites shutting down). Rounds that start within one poll make one
sample, counted under the latest.

Per process it reports the figures at round 10 and at the last round, and the least-squares slope
over the last 150 rounds (per 100 rounds, RSS in MiB, with its standard error), as a markdown table
and, with ``--out``, a JSON document (``{"machine", "runs": [{"mode", "status", "processes":
[...]}]}``, each process with its whole series). Goal: no growth beyond noise, and under 1 MiB
per 100 rounds for the server's RSS (``within_goal``). Exit code 0 when every job completed, 1
when one did not, 130 on Ctrl-C. Whatever it started is stopped and its temp folder removed
(unless ``--keep``) on Ctrl-C, SIGTERM or failure as well.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "jobs" / "fedavg"
#: The early figures are taken at this round (start-up and the first rounds' caches behind it).
EARLY_ROUND = 10
#: The slope is fitted over the samples of the last this many rounds.
WINDOW_ROUNDS = 150
#: The issue's goal for the server: its RSS grows by less than this per 100 rounds.
SERVER_RSS_GOAL_MIB = 1.0
POLL_INTERVAL_S = 0.01
STOP_TIMEOUT_S = 30.0
CLI_TIMEOUT_S = 120.0
FINAL = "FINISHED"


@dataclass(frozen=True)
class Sample:
    """One process at the end of one round."""

    round: int
    rss_mib: float
    fds: int
    threads: int


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares slope of ``ys`` over ``xs`` and its standard error (None under two distinct xs).

    The standard error is what the slope's noise amounts to: a slope within about two of them is
    no growth that these samples can tell from noise.
    """
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    if n == 2:
        return slope, 0.0
    residuals = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in zip(xs, ys, strict=True))
    return slope, (residuals / (n - 2) / sxx) ** 0.5


def summarize(
    samples: list[Sample], early_round: int = EARLY_ROUND, window_rounds: int = WINDOW_ROUNDS
) -> dict[str, Any]:
    """Figures at ``early_round`` (or the first sample after it; the last in a shorter run), at
    the last round, and slopes per 100 rounds over the samples of the last ``window_rounds`` rounds."""
    if not samples:
        raise ValueError("no samples to summarize")
    ordered = sorted(samples, key=lambda s: s.round)
    last = ordered[-1]
    early = next((s for s in ordered if s.round >= early_round), last)
    window = [s for s in ordered if s.round > last.round - window_rounds]
    slopes: dict[str, float | None] = {}
    for key in ("rss_mib", "fds", "threads"):
        fit = fit_line([s.round for s in window], [getattr(s, key) for s in window])
        slopes[key] = None if fit is None else round(fit[0] * 100, 4)
        if key == "rss_mib":
            slopes["rss_mib_stderr"] = None if fit is None else round(fit[1] * 100, 4)
    return {
        "samples": len(ordered),
        "early": asdict(early),
        "last": asdict(last),
        "window_rounds": [window[0].round, last.round],
        "slope_per_100_rounds": slopes,
    }


def process_name(cmdline: list[str]) -> str | None:
    """What a process of the run is, from its command line; None for the soak's own CLI calls."""
    if "engine.runtime.entry" in cmdline:
        return cmdline[cmdline.index("--site") + 1] if "--site" in cmdline else "job process"
    if "engine.runtime.launcher_process" in cmdline:
        return "launcher"
    if cmdline[1:4] == ["-m", "engine", "run"]:
        return "simulator"
    if cmdline[1:3] == ["-m", "engine"] and cmdline[3:5] in (["server", "start"], ["client", "start"]):
        return f"{Path(cmdline[5]).name} daemon"
    if cmdline[1:3] == ["-m", "engine"]:
        return None  # flengine poc / admin, started and waited for by this tool
    script = next((Path(word).name for word in cmdline if word.endswith(".py")), cmdline[0])
    return f"script {script}"


def processes_mentioning(text: str) -> dict[int, list[str]]:
    """pid -> command line of every live process but this one whose command line contains ``text``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            words = Path(f"/proc/{entry}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        cmdline = [word.decode(errors="replace").strip() for word in words]
        if any(text in word for word in cmdline):
            found[int(entry)] = cmdline
    return found


def read_process(pid: int, round_: int) -> Sample | None:
    """RSS, open fds and threads of ``pid`` now (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kib = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
        return Sample(round_, rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")))
    except (OSError, AttributeError):  # gone, or a zombie without VmRSS
        return None


class RoundSampler(threading.Thread):
    """Follows the server's ``events.jsonl`` and samples the run's processes as each round starts,
    under the round before it (the state after that round)."""

    def __init__(self, marker: str, events: Callable[[], Path | None]) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.marker, self.events = marker, events
        self.series: dict[int, list[Sample]] = {}
        self.names: dict[int, str] = {}
        self.rounds_done = 0
        self.cpu_s = 0.0
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(STOP_TIMEOUT_S)

    def run(self) -> None:
        cpu_started = time.thread_time()
        handle, pending = None, ""
        try:
            while not self._stop_event.wait(POLL_INTERVAL_S):
                if handle is None:
                    path = self.events()
                    handle = path.open(encoding="utf-8") if path is not None and path.exists() else None
                    continue
                pending += handle.read()
                *lines, pending = pending.split("\n")
                begun = [e["round"] for e in map(json_object_or_none, lines) if e and e.get("event") == "round_started"]
                if begun and max(begun) > 1:
                    self.rounds_done = max(self.rounds_done, max(begun) - 1)
                    self.sample(self.rounds_done)
        finally:
            if handle is not None:
                handle.close()
            self.cpu_s = time.thread_time() - cpu_started

    def sample(self, round_: int) -> None:
        for pid, cmdline in processes_mentioning(self.marker).items():
            name = self.names.get(pid) or process_name(cmdline)
            if name is not None and (sample := read_process(pid, round_)) is not None:
                self.names[pid] = name
                self.series.setdefault(pid, []).append(sample)

    def report(self) -> list[dict[str, Any]]:
        """Each process's summary and series, daemons after the job's processes."""
        rows = []
        for pid, samples in sorted(self.series.items(), key=lambda item: (_rank(self.names[item[0]]), item[0])):
            name = self.names[pid]
            summary = summarize(samples)
            if name.startswith("server"):
                slope = summary["slope_per_100_rounds"]["rss_mib"]
                summary["within_goal"] = slope is not None and slope < SERVER_RSS_GOAL_MIB
            series = {key: [getattr(s, key) for s in samples] for key in ("round", "rss_mib", "fds", "threads")}
            rows.append({"name": name, "pid": pid, **summary, "series": series})
        return rows


def _rank(name: str) -> tuple[int, str]:
    """Table order: the simulator and its launcher, the job's server, its sites, scripts, then the daemons."""
    order = ("simulator", "launcher", "server", "site", "script")
    first = name.split()[0] if name.endswith(" daemon") else name
    kind = next((k for k, prefix in enumerate(order) if first.startswith(prefix)), len(order))
    return (kind + (len(order) + 1 if name.endswith(" daemon") else 0), name)


def json_object_or_none(line: str) -> dict[str, Any] | None:
    """The JSON object on one line of an events file; None for a torn or foreign line."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def prepare_job(source: Path, folder: Path, rounds: int, clients: int) -> Path:
    """A copy of ``source`` in ``folder`` with ``num_rounds``, ``num_clients`` and ``min_clients`` set."""
    job = folder / source.name
    shutil.copytree(source, job)
    configs = sorted(job.glob("**/config_fed_server.*"))
    replaced = 0
    for config in configs:
        text, count = re.subn(r"\bnum_rounds(\s*[=:]\s*)\d+", rf"num_rounds\g<1>{rounds}", config.read_text())
        text = re.sub(r"\bnum_clients(\s*[=:]\s*)\d+", rf"num_clients\g<1>{clients}", text)
        config.write_text(text)
        replaced += count
    if replaced == 0:
        raise RuntimeError(f"{source}: no `num_rounds = N` in a config_fed_server file; give a FedAvg-like job")
    meta = job / "meta.conf"
    if meta.exists():
        meta.write_text(re.sub(r"\bmin_clients(\s*[=:]\s*)\d+", rf"min_clients\g<1>{clients}", meta.read_text()))
    return job


def run_sim(job: Path, root: Path, clients: int, timeout_s: float) -> dict[str, Any]:
    """``flengine run`` on ``job`` (inside ``root``), sampled every round; its processes stopped whatever happens."""
    workspace = root / "workspace"
    sampler = RoundSampler(str(root), lambda: workspace / "server" / "events.jsonl")
    command = [sys.executable, "-m", "engine", "run", str(job), "-n", str(clients), "--workspace", str(workspace)]
    with (root / "run-output.txt").open("w") as output:
        # A session of its own: a Ctrl-C reaches this tool only, which stops the run the way
        # flengine run expects (SIGINT, then every job process ends).
        process = subprocess.Popen([*command, "-q"], stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    sampler.start()
    try:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"flengine run {job}: still running after {timeout_s:g} s; stopped") from error
        seconds = time.monotonic() - started
    finally:
        sampler.stop()
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)
    summary_file = workspace / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    status = summary.get("status", f"flengine run exited {process.returncode}")
    return _run_record("sim", status, summary.get("reason", ""), seconds, sampler)


def run_poc(job: Path, root: Path, clients: int, timeout_s: float) -> dict[str, Any]:
    """The job (inside ``root``) in a POC on 127.0.0.1, sampled every round (daemons too); the POC stopped
    whatever happens."""
    from engine.deploy.poc.prepare import free_port_block

    poc = root / "poc"
    _flengine("poc", "prepare", "-d", str(poc), "-n", str(clients), "--port", str(free_port_block(11)))
    sampler = None
    try:
        _flengine("poc", "start", "-d", str(poc))
        submitted = json.loads(_flengine("admin", str(poc / "kits" / "admin"), "submit", str(job), "--format", "json"))
        store = poc / "workspaces" / "server" / "jobs" / submitted["job_id"]
        sampler = RoundSampler(str(root), lambda: store / "workspace" / "server" / "events.jsonl")
        started = time.monotonic()
        sampler.start()
        record = _wait_final(store / "meta.json", timeout_s)
        seconds = time.monotonic() - started
        sampler.stop()
        return _run_record("poc", record["status"], record.get("reason", ""), seconds, sampler)
    finally:
        if sampler is not None:
            sampler.stop()
        _flengine("poc", "stop", "-d", str(poc), check=False)


def _wait_final(meta: Path, timeout_s: float) -> dict[str, Any]:
    """The job's final record, from the job store (its ``meta.json`` is rewritten atomically by the server)."""
    deadline, waiting = time.monotonic() + timeout_s, threading.Event()
    record: dict[str, Any] = {"status": "SUBMITTED"}
    while time.monotonic() < deadline:
        record = json.loads(meta.read_text()) if meta.exists() else record
        if record["status"].startswith(FINAL):
            return record
        waiting.wait(0.5)
    raise RuntimeError(f"{meta}: the job is still {record['status']} after {timeout_s:g} s")


def _flengine(*args: str, check: bool = True) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "engine", *args],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False, start_new_session=True,
    )  # fmt: skip
    if check and done.returncode != 0:
        raise RuntimeError(f"flengine {' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _run_record(mode: str, status: str, reason: str, seconds: float, sampler: RoundSampler) -> dict[str, Any]:
    processes = sampler.report()
    return {
        "mode": mode,
        "status": status,
        "reason": reason,
        "seconds": round(seconds, 1),
        "rounds_done": sampler.rounds_done,
        "sampled_rounds": len({r for series in sampler.series.values() for r in (s.round for s in series)}),
        "sampler_cpu_s": round(sampler.cpu_s, 2),
        "processes": processes,
    }


def sweep(marker: str) -> list[str]:
    """Kill whatever still runs that names ``marker`` (SIGTERM, then SIGKILL); their command lines."""
    left = processes_mentioning(marker)
    for pid in left:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(pid in processes_mentioning(marker) for pid in left):
        time.sleep(0.1)
    for pid in processes_mentioning(marker):
        _signal(pid, signal.SIGKILL)
    return [" ".join(cmdline) for cmdline in left.values()]


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def markdown_table(runs: list[dict[str, Any]]) -> list[str]:
    """One row per process: RSS MiB / fds / threads early and last, and the slopes per 100 rounds."""
    lines = [
        "| mode | process | round 10: RSS MiB / fds / threads | last round: RSS MiB / fds / threads "
        "| per 100 rounds (window): RSS MiB / fds / threads |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        for p in run["processes"]:
            slope = p["slope_per_100_rounds"]
            rss = "-" if slope["rss_mib"] is None else f"{slope['rss_mib']:+.3f} ± {slope['rss_mib_stderr']:.3f}"
            fds, threads = (("-" if slope[k] is None else f"{slope[k]:+.2f}") for k in ("fds", "threads"))
            mark = " (above goal)" if p.get("within_goal") is False else ""
            window = "rounds {}-{}".format(*p["window_rounds"])
            lines.append(
                f"| {run['mode']} | {p['name']} | {_figures(p['early'])} | {_figures(p['last'])} "
                f"| {rss}{mark} / {fds} / {threads} ({window}) |"
            )
    return lines


def _figures(sample: dict[str, Any]) -> str:
    return f"{sample['rss_mib']:.1f} / {sample['fds']} / {sample['threads']} (round {sample['round']})"


def machine() -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text()
    mem_kib = int(re.search(r"^MemTotal:\s+(\d+)", meminfo, re.M).group(1))  # type: ignore[union-attr]
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.rounds < 2 or args.clients < 1:
        print("Error: --rounds must be at least 2 and --clients at least 1", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    root = Path(tempfile.mkdtemp(prefix="flengine-soak-"))
    document: dict[str, Any] = {
        "rounds": args.rounds, "job_rounds": args.rounds + 1, "clients": args.clients, "machine": machine(), "runs": [],
    }  # fmt: skip
    try:
        source = Path(args.job).resolve()
        document["job"] = str(source)
        timeout_s = 300.0 + 5.0 * args.rounds
        for mode in ("sim", "poc") if args.mode == "both" else (args.mode,):
            print(f"soak: {mode}, {args.rounds} rounds, {args.clients} clients ...", file=sys.stderr, flush=True)
            job = prepare_job(source, root / mode, args.rounds + 1, args.clients)
            run = run_sim if mode == "sim" else run_poc
            document["runs"].append(run(job, root / mode, args.clients, timeout_s))
            if args.out:
                Path(args.out).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    except KeyboardInterrupt:
        print("soak: interrupted; stopping what it started", file=sys.stderr)
        return 130
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    finally:
        left = sweep(str(root))
        if left:
            print(f"soak: killed {len(left)} process(es) left behind: {left}", file=sys.stderr)
        if args.keep:
            print(f"soak: kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    for run in document["runs"]:
        reason = f" ({run['reason']})" if run["reason"] else ""
        print(f"{run['mode']}: {run['status']}{reason} in {run['seconds']:g} s, {run['sampled_rounds']} rounds sampled")
    print("\n".join(markdown_table(document["runs"])))
    return 0 if all(run["status"] == "FINISHED_COMPLETED" for run in document["runs"]) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["sim", "poc", "both"], default="both", help="default both (sim, then poc)")
    parser.add_argument("--rounds", type=int, default=200, help="rounds of the job (default 200)")
    parser.add_argument("--clients", type=int, default=2, help="sites (default 2)")
    parser.add_argument("--job", default=str(DEFAULT_JOB), help="a FedAvg-like job folder (default jobs/fedavg)")
    parser.add_argument("--out", help="write the JSON document here")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (jobs, workspaces, POC)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
