"""`WorkerPlan`: which worker process runs which virtual clients of a simulation.

``flengine run JOB -n 10000 -t 4`` runs ``site-1`` .. ``site-10000`` on four worker processes,
``worker-1`` .. ``worker-4``, each given every fourth client (round robin, so the clients a round
samples spread over the workers). The simulator writes the plan into the run's workspace
(`SITES_FILE`); the server reads it to know which worker's key speaks for which clients (the
allowlist's delegation) and the workers read it to know their own clients and, for the Client
API's ``get_site_index``, the job's sites in order. The file is the simulator's, in a folder only
its user can write, but it is still read as data: every name is checked, no name is given twice.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from engine.errors import UsageError

#: The plan's file in the run's workspace.
SITES_FILE = "sites.json"
#: Workers are named ``worker-1`` .. ``worker-W``.
WORKER_PREFIX = "worker-"
#: The largest plan file read, in bytes (10,000 clients take about 250 KB).
MAX_SITES_FILE_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """The job's client sites in order, and the clients each worker runs.

    Args:
        clients: Every client site of the job, in the order the Client API counts them.
        workers: Worker name -> the clients it runs; each client belongs to exactly one worker.

    Raises:
        UsageError: A name used twice, a worker that is also a client, a client no worker runs.
    """

    clients: tuple[str, ...]
    workers: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        clients = tuple(self.clients)
        workers = {str(worker): tuple(names) for worker, names in self.workers.items()}
        for name in [*clients, *workers]:
            _check_name(name)
        if len(set(clients)) != len(clients):
            raise UsageError(f"{SITES_FILE}: a client is listed twice")
        owner: dict[str, str] = {}
        for worker, names in workers.items():
            if worker in clients or worker == "server":
                raise UsageError(f"{SITES_FILE}: worker {worker!r} has the name of a site")
            for name in names:
                if owner.setdefault(name, worker) != worker:
                    raise UsageError(f"{SITES_FILE}: {name!r} is given to both {owner[name]!r} and {worker!r}")
        if set(owner) != set(clients):
            missing = sorted(set(clients) - set(owner))[:5]
            extra = sorted(set(owner) - set(clients))[:5]
            raise UsageError(
                f"{SITES_FILE}: clients without a worker {missing}, or workers' names no client has {extra}"
            )
        object.__setattr__(self, "clients", clients)
        object.__setattr__(self, "workers", workers)
        object.__setattr__(self, "_owner", owner)

    @classmethod
    def round_robin(cls, clients: Sequence[str], n_workers: int) -> WorkerPlan:
        """``n_workers`` workers (at most one per client), worker ``k`` running every ``k``-th client."""
        if n_workers < 1:
            raise UsageError(f"-t: expected at least 1 worker, got {n_workers}")
        count = min(n_workers, len(clients))
        workers = {f"{WORKER_PREFIX}{k + 1}": tuple(clients[k::count]) for k in range(count)}
        return cls(tuple(clients), workers)

    def worker_of(self, client: str) -> str | None:
        """The worker that runs ``client``, or None."""
        return self._owner.get(client)  # type: ignore[attr-defined]

    def write(self, folder: Path) -> Path:
        """Write the plan as ``folder/SITES_FILE``; return the file."""
        path = folder / SITES_FILE
        record = {"clients": list(self.clients), "workers": {w: list(names) for w, names in self.workers.items()}}
        path.write_text(json.dumps(record) + "\n", encoding="utf-8")
        return path

    @classmethod
    def read(cls, path: Path) -> WorkerPlan:
        """The plan in ``path`` (see `write`).

        Raises:
            UsageError: The file is missing, too large, not JSON, or not a valid plan; the message names it.
        """
        try:
            with path.open("rb") as stream:
                raw = stream.read(MAX_SITES_FILE_BYTES + 1)
            if len(raw) > MAX_SITES_FILE_BYTES:
                raise ValueError(f"larger than {MAX_SITES_FILE_BYTES} bytes")
            record = json.loads(raw)
            clients, workers = record["clients"], record["workers"]
            if not isinstance(clients, list) or not isinstance(workers, dict):
                raise ValueError("expected {'clients': [...], 'workers': {...}}")
            if not all(isinstance(names, list) for names in workers.values()):
                raise ValueError("each worker's clients must be a list")
            return cls(tuple(clients), {worker: tuple(names) for worker, names in workers.items()})
        except UsageError as e:
            raise UsageError(f"{path}: {e}") from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: not a worker plan ({e})") from e


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or "." in name or "," in name or len(name) > 128:
        raise UsageError(f"{SITES_FILE}: {name!r} is not a site name")
