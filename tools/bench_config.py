"""Benchmark of config loading: a server config of about 10 KB, 1 MB and 10 MB, loaded and validated.

    python tools/bench_config.py [--sizes 10k 1m 10m] [--repeat 3] [--json] [--out FILE]

For each size, writes a job folder (``meta.conf``, ``app/config/config_fed_server.conf``,
``app/config/config_fed_client.conf``) into a temporary folder. The server config is a
realistic one grown to the size: a FedAvg workflow, a persistor whose model args hold a big list
(``class_weights``, 80 % of the bytes, floats written ``0.123457``) and an object of many keys
(``layer_widths``, one ``layer_00001 = 64`` line each), in plain HOCON, plus a comment per
section. Two figures, each the best of ``--repeat`` runs:

- ``load_and_schema_s``: `load_config` of the server config, then its schema check;
- ``validate_job_s``: `validate_job` of the whole folder as a server checks a job it receives
  (``build=False, environment=False``), which reads all three files.

A config over a limit of `engine.config.limits` (the 10 MB one holds more than
`MAX_CONFIG_VALUES` values) is refused: the figures then time the refusal, and ``refused``
gives the problem. Prints a table; ``--json`` prints JSON instead:
``{"python": ..., "runs": [{"size", "bytes", "values", "load_and_schema_s", "validate_job_s",
"refused"}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import load_config, validate_job  # noqa: E402
from engine.config.schema import check_document  # noqa: E402
from engine.errors import ConfigError  # noqa: E402

SIZES = {"10k": 10_000, "1m": 1_000_000, "10m": 10_000_000}
SERVER_CONFIG = "app/config/config_fed_server.conf"
META = 'name = bench\nmin_clients = 2\ndeploy_map { app = ["@ALL"] }\n'
CLIENT = """\
format_version = 2
executors = [
  { tasks = ["*"], executor { path = engine.executors.ClientAPIExecutor, args { task_script_path = train.py } } }
]
"""
HEADER = """\
# Server side of a FedAvg job, grown for tools/bench_config.py.
format_version = 2

# Streaming of models between server and clients (bytes; 0 = send tensors inline).
tensor_download_chunk_size = 2097152
np_download_chunk_size = 2097152
streaming_per_request_timeout = 600     # seconds one chunk request may take

workflows = [
  {
    id = fedavg
    path = engine.workflows.FedAvg
    args {
      num_clients = 2
      num_rounds = 3
      persistor_id = persistor
      download_to_disk = false
    }
  }
]

components = [
  {
    id = persistor
    path = engine.persistors.PTFileModelPersistor
    args {
      key_metric = global_accuracy
      model {
        path = net.Net
        args {
          hidden = 64
          # one weight per class, for the loss
          class_weights = [
"""
MIDDLE = """\
          ]
          # the width of each layer, by name
          layer_widths {
"""
FOOTER = """\
          }
        }
      }
    }
  }
]

task_data_filters = []
task_result_filters = []
"""


def server_config(size_bytes: int) -> str:
    """A server config of about ``size_bytes``: 80 % a list of floats, the rest an object of many keys."""
    fixed = len(HEADER) + len(MIDDLE) + len(FOOTER)
    budget = max(size_bytes - fixed, 0)
    per_line = 10  # floats per line of the list
    float_lines = (budget * 8 // 10) // (per_line * 10 + 12)
    weights = "".join(
        "            " + ", ".join(f"0.{(line * per_line + k) % 999_983:06d}" for k in range(per_line)) + ",\n"
        for line in range(float_lines)
    )
    key_lines = (budget - len(weights)) // 31
    widths = "".join(f"            layer_{i:06d} = {32 + i % 480}\n" for i in range(key_lines))
    return HEADER + weights + MIDDLE + widths + FOOTER


def write_job(folder: Path, server_text: str) -> None:
    """Write a job folder whose server config is ``server_text``."""
    for name, text in (
        ("meta.conf", META),
        (SERVER_CONFIG, server_text),
        ("app/config/config_fed_client.conf", CLIENT),
    ):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def best_of(repeat: int, run: Callable[[], object]) -> tuple[float, object]:
    """The shortest of ``repeat`` runs in seconds, with what the last run returned (or raised)."""
    best, outcome = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            outcome = run()
        except ConfigError as e:
            outcome = e
        best = min(best, time.perf_counter() - start)
    return best, outcome


def measure(size: str, folder: Path, repeat: int) -> dict[str, object]:
    """Time one size: load + schema check, then validate_job; say what was refused."""
    job = folder / size
    write_job(job, server_config(SIZES[size]))
    server = job / SERVER_CONFIG

    def load_and_check() -> int:
        document = load_config(server, SERVER_CONFIG, job, environment=False)
        problems = check_document(document, "config_fed_server")
        if problems:
            raise ConfigError(problems)
        return sum(1 for _ in document.key_lines)

    load_s, loaded = best_of(repeat, load_and_check)
    validate_s, problems = best_of(repeat, lambda: validate_job(job, build=False, environment=False))
    if isinstance(loaded, ConfigError):
        refused = str(loaded)
    else:
        refused = "; ".join(str(problem) for problem in problems) if isinstance(problems, list) else ""
    return {
        "size": size,
        "bytes": server.stat().st_size,
        "key_paths": loaded if isinstance(loaded, int) else None,
        "load_and_schema_s": round(load_s, 4),
        "validate_job_s": round(validate_s, 4),
        "refused": refused or None,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table, or JSON with ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="config sizes")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-config-") as tmp:
        runs = [measure(size, Path(tmp), args.repeat) for size in args.sizes]
    result = {"python": platform.python_version(), "repeat": args.repeat, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'size':>5} {'bytes':>10} {'key paths':>10} {'load+schema':>12} {'validate_job':>13}  refused")
    for run in runs:
        key_paths = "-" if run["key_paths"] is None else run["key_paths"]
        print(
            f"{run['size']:>5} {run['bytes']:>10} {key_paths:>10} {run['load_and_schema_s']:>11.3f}s "
            f"{run['validate_job_s']:>12.3f}s  {run['refused'] or '-'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
