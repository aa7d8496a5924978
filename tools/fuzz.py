"""Run the fuzz properties of ``tests/fuzz`` for longer than CI does, and count the inputs they try.

    python tools/fuzz.py --minutes N [--decoder NAME ...] [--examples K] [--out FILE]

The properties are the ones ``pytest tests/fuzz`` runs in CI, run by pytest (so fixtures such
as the admin test's server daemon are real) under the ``fuzz-long`` Hypothesis profile: each
property is run again and again, ``--examples`` fresh random inputs a run (default 1000), until
its share of the time is spent. ``--minutes`` is split evenly over the decoders, and a
decoder's share evenly over its properties. Decoders (``--decoder``, repeatable; all by
default): ``cell-envelope``, ``fobs``, ``safetensors``, ``config``, ``job-archive``,
``admin-protocol``.

A property that fails stops at its first failure, which Hypothesis has shrunk to a small input
and prints with the ``@reproduce_failure`` line to keep as a regression example. Prints one
line per decoder: inputs tried, properties failed. ``--out FILE`` writes the same as JSON:
``{"minutes", "examples_per_run", "hypothesis", "python", "decoders": {NAME: {"inputs_tried",
"properties", "failed": [{"test", "error"}]}}}``. Exits 1 when a property failed. A run that
hangs (an input a decoder never finishes) is stopped with every thread's stack printed.
"""

from __future__ import annotations

import argparse
import faulthandler
import inspect
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Decoder name -> the module of its properties.
DECODERS = {
    "cell-envelope": "tests/fuzz/test_cell_envelope.py",
    "fobs": "tests/fuzz/test_fobs.py",
    "safetensors": "tests/fuzz/test_safetensors.py",
    "config": "tests/fuzz/test_config_loader.py",
    "job-archive": "tests/fuzz/test_job_archive.py",
    "admin-protocol": "tests/fuzz/test_admin_protocol.py",
}


class LongRun:
    """A pytest plugin that runs each Hypothesis property until its time is spent, counting inputs.

    Args:
        seconds_per_decoder: Time each decoder's properties share, in seconds.
    """

    def __init__(self, seconds_per_decoder: float) -> None:
        self.seconds_per_decoder = seconds_per_decoder
        self.tried: dict[str, int] = defaultdict(int)
        self.properties: dict[str, int] = defaultdict(int)
        self.failed: dict[str, list[dict[str, str]]] = defaultdict(list)
        self._seconds: dict[str, float] = {}

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        """Give every property its share of its decoder's time."""
        by_decoder: dict[str, list[Any]] = defaultdict(list)
        for item in items:
            if hasattr(getattr(item, "obj", None), "hypothesis"):
                by_decoder[decoder_of(item.nodeid)].append(item)
        for decoder, properties in by_decoder.items():
            self.properties[decoder] = len(properties)
            for item in properties:
                self._seconds[item.nodeid] = self.seconds_per_decoder / len(properties)

    def pytest_pyfunc_call(self, pyfuncitem: Any) -> bool | None:
        """Run a property run after run until its time is spent; other tests run once, as usual."""
        test = pyfuncitem.obj
        if pyfuncitem.nodeid not in self._seconds:
            return None
        decoder = decoder_of(pyfuncitem.nodeid)
        inner = test.hypothesis.inner_test

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.tried[decoder] += 1
            return inner(*args, **kwargs)

        fixtures = {name: pyfuncitem.funcargs[name] for name in inspect.signature(test).parameters}
        test.hypothesis.inner_test = counted  # Hypothesis's documented hook for wrapping the test body
        try:
            stop_at = time.monotonic() + self._seconds[pyfuncitem.nodeid]
            while True:
                test(**fixtures)
                if time.monotonic() >= stop_at:
                    break
        finally:
            test.hypothesis.inner_test = inner
        return True

    def pytest_runtest_logreport(self, report: Any) -> None:
        """Remember each failed property and the last line of its error."""
        if report.failed and report.when == "call":
            crash = getattr(report.longrepr, "reprcrash", None)
            error = crash.message if crash is not None else str(report.longrepr).splitlines()[-1]
            self.failed[decoder_of(report.nodeid)].append({"test": report.nodeid, "error": error})


def decoder_of(nodeid: str) -> str:
    """The decoder whose module holds the test ``nodeid``."""
    path = nodeid.split("::", 1)[0]
    return next((name for name, module in DECODERS.items() if module == path), path)


def main(argv: list[str] | None = None) -> int:
    """Run the properties; return 1 when one failed, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=float, required=True, help="time for all the chosen decoders together")
    parser.add_argument("--decoder", action="append", choices=sorted(DECODERS), help="a decoder to fuzz (repeatable)")
    parser.add_argument("--examples", type=int, default=1000, help="random inputs per run of a property")
    parser.add_argument("--out", type=Path, help="write the summary as JSON to this file")
    args = parser.parse_args(argv)
    decoders = args.decoder or list(DECODERS)
    if args.minutes <= 0 or args.examples <= 0:
        parser.error("--minutes and --examples must be > 0")

    # Read by tests/fuzz/strategies.py when pytest imports the properties.
    os.environ["FLENGINE_FUZZ_PROFILE"] = "fuzz-long"
    os.environ["FLENGINE_FUZZ_EXAMPLES"] = str(args.examples)
    import pytest

    seconds = args.minutes * 60
    faulthandler.dump_traceback_later(seconds * 2 + 300, exit=True)  # a hang ends the run, with stacks
    plugin = LongRun(seconds / len(decoders))
    started = time.monotonic()
    pytest.main(
        ["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *(str(ROOT / DECODERS[name]) for name in decoders)],
        plugins=[plugin],
    )
    faulthandler.cancel_dump_traceback_later()
    import hypothesis  # after the run: imported first, pytest could not rewrite its plugin's asserts

    summary = {
        "minutes": round((time.monotonic() - started) / 60, 2),
        "examples_per_run": args.examples,
        "hypothesis": hypothesis.__version__,
        "python": platform.python_version(),
        "decoders": {
            name: {
                "inputs_tried": plugin.tried[name],
                "properties": plugin.properties[name],
                "failed": plugin.failed[name],
            }
            for name in decoders
        },
    }
    print(f"\n{'decoder':<16} {'inputs tried':>12} {'properties':>10} {'failed':>6}")
    for name, figures in summary["decoders"].items():
        print(f"{name:<16} {figures['inputs_tried']:>12} {figures['properties']:>10} {len(figures['failed']):>6}")
        for failure in figures["failed"]:
            print(f"    {failure['test']}: {failure['error']}")
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 1 if any(plugin.failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
