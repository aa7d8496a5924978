"""`run_warnings`: what in a job does not fit the clients of a `flengine run`, said before it starts."""

from __future__ import annotations

from typing import Any

from engine.config import Job
from engine.config.build import is_engine_component, resolve_dotted_path
from engine.config.signature import accepted_args
from engine.errors import DottedPathError


def run_warnings(job: Job, clients: list[str]) -> list[str]:
    """What in the job does not fit a run with these clients: said before the run, not an error.

    - A workflow that samples ``num_clients`` per round (FedAvg) with fewer than the run has:
      the others sit idle in some rounds, or in every round.

    Returns:
        One line per finding, naming the config file, its line, the key path and the fix.
    """
    n = len(clients)
    warnings = []
    server_app = job.app_for("server")
    server = server_app.server if server_app is not None else None
    if server is not None:
        for i, entry in enumerate(server.data.get("workflows", [])):
            sampled = _num_clients(entry)
            if sampled is not None and sampled < n:
                message = f"{sampled} clients sampled per round, but the run has {n}: each round trains only {sampled}"
                hint = f"set num_clients = {n} to train them all"
                warnings.append(str(server.problem(("workflows", i, "args", "num_clients"), message, hint)))
    return warnings


def _num_clients(entry: Any) -> int | None:
    """The ``num_clients`` a workflow entry samples: written in its args, else its class's default."""
    if not isinstance(entry, dict):
        return None
    args = entry.get("args", {})
    if isinstance(args, dict) and args.get("sample_fraction") is not None:
        return None  # FedAvg samples a fraction of the clients then, whatever num_clients says
    if isinstance(args, dict) and "num_clients" in args:
        value = args["num_clients"]
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    path = entry.get("path")
    if not isinstance(path, str) or not is_engine_component(path):
        return None  # the job's own class: not imported here
    try:
        accepted = accepted_args(resolve_dotted_path(path))  # FedOpt's num_clients is FedAvg's, through **kwargs
    except DottedPathError:
        return None
    parameter = accepted.parameters.get("num_clients") if accepted is not None else None
    default = parameter.default if parameter is not None else None
    return default if isinstance(default, int) and not isinstance(default, bool) else None
