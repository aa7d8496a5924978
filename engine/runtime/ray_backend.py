"""`RayWorkers`: the workers of a simulation's virtual clients as Ray actors (``flengine run -t W --backend ray``).

Each worker (`engine.runtime.worker`) runs in a Ray actor instead of a process the simulator's
launcher forks: on this machine by default (a Ray instance started for the run and stopped
with it), or on an existing Ray cluster given by its address. The server stays one process of
this machine; the workers connect to it as any client does, with their own keys over CURVE. An
actor's CPUs and GPUs come from the command line (``--worker-cpus``, ``--worker-gpus``).

On a cluster, every node that may host a worker must see the job folder and the run's workspace
at the same paths (a shared file system), and reach the server's address (the job's
``cell.host``). Without ``--worker-cpus``/``--worker-gpus``, an actor reserves the most
``num_cpus``/``num_gpus`` the job's ``resource_spec`` (meta.conf) asks of a site, else 1 CPU and
no GPU.

Ray is an optional extra (``pip install flengine[ray]``); this module imports it only when a
run starts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from engine.errors import UsageError

log = logging.getLogger(__name__)

#: Exit code given to a worker whose actor died (Ray says only that it is gone).
ACTOR_DIED_CODE = -9
#: Seconds to wait for an actor to stop once killed.
KILL_WAIT_S = 5.0


def _most(resource_spec: Mapping[str, Any] | None, key: str, default: float) -> float:
    """The largest number ``key`` of any site in ``resource_spec``, or ``default``."""
    amounts = [
        float(resources[key])
        for resources in (resource_spec or {}).values()
        if isinstance(resources, Mapping)
        and isinstance(resources.get(key), (int, float))
        and not isinstance(resources.get(key), bool)
        and resources[key] >= 0
    ]
    return max(amounts, default=default)


class _WorkerActor:
    """The body of a worker actor: one call of ``engine.runtime.entry.main`` with the worker's arguments."""

    def run(self, argv: list[str]) -> int:
        from engine.runtime.entry import main

        return main(argv)


class RayProcess:
    """A worker running in a Ray actor; the part of `subprocess.Popen`'s API the simulator uses.

    Attributes:
        site: The worker's name.
        returncode: Its exit code once it ended (`ACTOR_DIED_CODE` when the actor died), else None.
    """

    def __init__(self, site: str, actor: Any, result: Any) -> None:
        self.site = site
        self.returncode: int | None = None
        self._actor = actor
        self._result = result

    def poll(self) -> int | None:
        """The exit code if the worker ended, else None."""
        if self.returncode is None:
            import ray

            ready, _ = ray.wait([self._result], timeout=0)
            if ready:
                self._collect(ray)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds for the worker to end; its exit code, or None if it still runs."""
        import ray

        if self.returncode is None:
            ready, _ = ray.wait([self._result], timeout=timeout)
            if ready:
                self._collect(ray)
        return self.returncode

    def terminate(self) -> None:
        """End the actor (Ray has no gentler stop for a running call)."""
        self.kill()

    def kill(self) -> None:
        """End the actor now."""
        import ray

        with contextlib.suppress(Exception):  # already gone
            ray.kill(self._actor, no_restart=True)

    def _collect(self, ray: Any) -> None:
        try:
            code = ray.get(self._result)
            self.returncode = int(code) if isinstance(code, int) else 1
        except Exception as e:  # RayActorError and kin: the actor died (killed, out of memory)
            log.warning("worker actor ended site=%s: %s", self.site, type(e).__name__)
            self.returncode = ACTOR_DIED_CODE


class RayWorkers:
    """Starts the workers of one run as Ray actors.

    Args:
        address: An existing Ray cluster's address (``ray://host:10001`` or ``host:6379``);
            None starts a local Ray instance for the run.
        cpus: CPUs each worker actor reserves (default: the job's ``resource_spec``, else 1).
        gpus: GPUs each worker actor reserves (default: the job's ``resource_spec``, else 0).
    """

    def __init__(self, address: str | None = None, cpus: float | None = None, gpus: float | None = None) -> None:
        for name, value in (("--worker-cpus", cpus), ("--worker-gpus", gpus)):
            if value is not None and value < 0:
                raise UsageError(f"{name}: expected a number >= 0, got {value}")
        self.address = address
        self.cpus = cpus
        self.gpus = gpus
        self._started_ray = False
        self._actor_class: Any = None
        self._processes: list[RayProcess] = []

    def open(self, workers: int, resource_spec: Mapping[str, Any] | None = None) -> None:
        """Connect to Ray (start a local instance unless an address was given) for ``workers`` workers.

        Args:
            workers: How many worker actors the run starts.
            resource_spec: The job's ``resource_spec`` (site -> resources), for the CPUs and GPUs
                not given on the command line.

        Raises:
            UsageError: Ray is not installed, or the cluster cannot be reached.
        """
        if self.cpus is None:
            self.cpus = _most(resource_spec, "num_cpus", 1.0)
        if self.gpus is None:
            self.gpus = _most(resource_spec, "num_gpus", 0.0)
        try:
            import ray
        except ImportError as e:
            raise UsageError("--backend ray needs Ray: pip install flengine[ray]") from e
        if not ray.is_initialized():
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "WARNING"}
            if self.address is None:  # room for every worker on this machine, whatever its core count
                options["num_cpus"] = max(workers * self.cpus, 1)
            try:
                ray.init(address=self.address, **options)
            except Exception as e:  # ConnectionError and Ray's own: the cluster is not there
                raise UsageError(f"--backend ray: cannot start or reach Ray ({type(e).__name__}: {e})") from e
            self._started_ray = True
        available = ray.cluster_resources()
        for name, need in (("CPU", self.cpus), ("GPU", self.gpus)):
            if need > available.get(name, 0.0):  # an actor that cannot be placed would wait for ever
                self.stop_all(0.0)
                raise UsageError(
                    f"--backend ray: a worker actor needs {need:g} {name}(s); the Ray cluster has "
                    f"{available.get(name, 0.0):g} (--worker-cpus, --worker-gpus, or the job's resource_spec)"
                )
        self._actor_class = ray.remote(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0)(_WorkerActor)

    def start(self, site: str, argv: list[str]) -> RayProcess:
        """Start worker ``site`` (``python -m engine.runtime.entry *argv`` in an actor)."""
        if self._actor_class is None:
            raise RuntimeError("RayWorkers.start: call open() first")
        actor = self._actor_class.options(name=None).remote()
        process = RayProcess(site, actor, actor.run.remote(argv))
        self._processes.append(process)
        return process

    def stop_all(self, grace_s: float) -> None:
        """Give the workers ``grace_s`` seconds to end by themselves, then end their actors; stop a Ray started here."""
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.wait(max(deadline - time.monotonic(), 0.1))
        for process in self._processes:
            process.kill()
        self._processes.clear()
        if self._started_ray:
            import ray

            with contextlib.suppress(Exception):
                ray.shutdown()
            self._started_ray = False
