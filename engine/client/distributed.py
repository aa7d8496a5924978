"""The Client API of a script launched on several processes (``torchrun``): rank 0 talks to the engine.

A training script started by ``command = "torchrun --standalone --nproc_per_node 2"`` runs as
``WORLD_SIZE`` processes. `connect_from_environment` (what ``flare.init()`` calls) gives each
the same Client API:

- **rank 0** (the leader) opens the one connection to the executor; ``receive()`` takes the task
  from it and broadcasts it (task name, meta, metrics, every tensor) to the other ranks;
- **ranks > 0** (the followers) never connect: their ``receive()`` returns the broadcast copy,
  their ``send()`` and ``log()`` return at once (only rank 0's result and metrics count), and
  ``is_running()`` turns False on every rank in the same ``receive()``.

So the script is the single-process one: every rank calls ``flare.receive()`` and
``flare.send()`` once per task, in the same order. ``receive()`` is a collective call: the
script must have called ``torch.distributed.init_process_group`` before it, on every rank (a
rank that skips it leaves the others waiting until the process group's timeout). Tasks travel
as CPU tensors over gloo: in the default group when it is gloo, else in a gloo group made at the
first ``receive()``.

While rank 0 waits for the next task (the server may be aggregating for a long time) it
broadcasts a small "still waiting" message every `WAIT_SLICE_S` seconds, so the other ranks never
sit in one collective call longer than that, and the process group's timeout is not reached.

Example:
    >>> import torch.distributed as dist
    >>> from engine import client as flare
    >>> dist.init_process_group("gloo")        # "nccl" on GPUs; before the first receive()
    >>> flare.init()
    >>> while flare.is_running():
    ...     model = flare.receive(into=ddp.module)   # every rank: the same weights, in its own network
    ...     if model is None:
    ...         break
    ...     steps = train(ddp)                       # DDP all-reduces the gradients
    ...     flare.send(FLModel(params=ddp.module.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": steps}))
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.client.backends import (
    ENV_ENDPOINT,
    ENV_JOB,
    ENV_SITE,
    ENV_STATE_DIR,
    Backend,
    SubprocessBackend,
    job_sites_from_environment,
)
from engine.client.broadcast import TaskChannel
from engine.client.exchange import TaskItem
from engine.errors import ClientAPIError
from engine.model import FLModel
from engine.site import ScriptCredentials

log = logging.getLogger(__name__)

#: Environment variables torchrun (and most launchers) set for each process.
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
#: Longest time rank 0 waits for a task before telling the other ranks it is still waiting.
WAIT_SLICE_S = 30.0

# What rank 0 tells the others in the first message of a receive().
_TASK, _WAIT, _TIMEOUT, _END, _FAILED = range(5)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process stands in a multi-process launch (torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_leader(self) -> bool:
        """Whether this process is rank 0, the one that talks to the engine."""
        return self.rank == 0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Ranks:
        """The ranks in ``environ`` (``os.environ`` by default); one process of one when none are set.

        Raises:
            ClientAPIError: A variable is not a whole number, or ``RANK`` is not below ``WORLD_SIZE``.
        """
        environ = os.environ if environ is None else environ
        world_size = _whole(environ, ENV_WORLD_SIZE, 1)
        rank = _whole(environ, ENV_RANK, 0)
        local_rank = _whole(environ, ENV_LOCAL_RANK, 0)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ClientAPIError(
                f"flare.init(): {ENV_RANK}={rank} and {ENV_WORLD_SIZE}={world_size} do not fit (0 <= RANK < "
                "WORLD_SIZE); start the script with torchrun, which sets them"
            )
        return cls(rank, world_size, local_rank)


def _whole(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise ClientAPIError(f"flare.init(): {name}={text!r} is not a whole number") from None


def connect_from_environment() -> Backend:
    """The backend ``flare.init()`` installs in a script the executor started as a process.

    One process: the `SubprocessBackend`. Several (``WORLD_SIZE > 1``): a `DistributedBackend`,
    which on rank 0 wraps the `SubprocessBackend` and on the other ranks opens no connection and
    removes the executor's address and keys from this process's environment.
    """
    ranks = Ranks.from_environment()
    if ranks.world_size == 1:
        return SubprocessBackend.from_environment()
    site, job = os.environ.get(ENV_SITE, "site"), os.environ.get(ENV_JOB, "job")
    sites = job_sites_from_environment(os.environ)
    if ranks.is_leader:
        return DistributedBackend(ranks, SubprocessBackend.from_environment(), site, job, job_sites=sites)
    _forget_connection_settings(os.environ)
    return DistributedBackend(ranks, None, site, job, job_sites=sites)


def _state_dir() -> Path | None:
    """The site's state folder the executor named (every rank may read and write it)."""
    folder = os.environ.get(ENV_STATE_DIR)
    return Path(folder) if folder else None


def _forget_connection_settings(environ: Any) -> None:
    """Drop the executor's address and the script's keys: only rank 0 may use them."""
    credentials = ScriptCredentials.from_environment(environ)
    for name in [ENV_ENDPOINT, *(credentials.to_environment() if credentials is not None else ())]:
        environ.pop(name, None)


class DistributedBackend(Backend):
    """The Client API of one rank of a multi-process script; see the module's docstring.

    Args:
        ranks: This process's rank and the world size.
        leader: Rank 0's connection to the executor (a `SubprocessBackend`); None on other ranks.
        site_name: This client's name.
        job_id: The running job's id.
        wait_slice_s: Longest time rank 0 waits for a task before telling the others it still waits.
        broadcast: Broadcasts a CPU tensor from rank 0 in place on every rank; by default
            ``torch.distributed.broadcast`` in the default group (when it runs gloo) or in a
            gloo group of every rank, made at the first `receive`.
        job_sites: Every client site of the job, in order (see `Backend`).
    """

    def __init__(
        self,
        ranks: Ranks,
        leader: Backend | None,
        site_name: str,
        job_id: str,
        wait_slice_s: float = WAIT_SLICE_S,
        broadcast: Callable[[Any], None] | None = None,
        job_sites: Sequence[str] = (),
    ) -> None:
        if (leader is not None) != ranks.is_leader:
            raise ValueError(f"rank {ranks.rank}: only rank 0 holds the connection to the executor")
        if wait_slice_s <= 0:
            raise ValueError(f"wait_slice_s: expected seconds > 0, got {wait_slice_s}")
        super().__init__(site_name, job_id, job_sites, leader.state_dir if leader is not None else _state_dir())
        self.ranks = ranks
        self._leader = leader
        self._wait_slice_s = wait_slice_s
        self._running = True
        self._broadcast = broadcast

    def receive(self, timeout_s: float | None) -> TaskItem | None:
        """The next task on every rank (a collective call); None on every rank when the run ended or timed out.

        ``timeout_s`` counts on rank 0; the other ranks return when it does.
        """
        return self._receive(timeout_s, None)

    def receive_into(self, timeout_s: float | None, targets: dict[str, Any]) -> TaskItem | None:
        """`receive` with the weights written into ``targets`` on every rank.

        Rank 0 receives straight into its targets where it can; the other ranks get the
        broadcast straight into theirs when every tensor fits (CPU, contiguous, the same names,
        dtypes and shapes), and into new memory that is then copied in otherwise.
        """
        return self._receive(timeout_s, targets)

    def _receive(self, timeout_s: float | None, targets: dict[str, Any] | None) -> TaskItem | None:
        if self._broadcast is None:
            self._broadcast = self._default_broadcast()
        channel = TaskChannel(self._broadcast)
        if self._leader is not None:
            item = self._lead(channel, timeout_s, targets)
        else:
            item = self._follow(channel, targets)
            if item is not None and targets is not None:
                return self._filled(item, targets)
        self.current = item
        return item

    def send(self, model: FLModel) -> None:
        """Rank 0 sends the result; on the other ranks this returns at once."""
        if self._leader is not None:
            self._leader.send(model)
        self.current = None

    def is_running(self) -> bool:
        """True until a `receive` saw the run's end; the same on every rank."""
        return self._running

    def log(self, key: str, value: Any) -> None:
        """Rank 0 records the metric; on the other ranks this returns at once."""
        if self._leader is not None:
            self._leader.log(key, value)

    def close(self) -> None:
        self._running = False
        if self._leader is not None:
            self._leader.close()

    # ----------------------------------------------------------------- rank 0

    def _lead(self, channel: TaskChannel, timeout_s: float | None, targets: dict[str, Any] | None) -> TaskItem | None:
        assert self._leader is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = self._wait_slice_s
            if deadline is not None:
                wait_s = max(min(wait_s, deadline - time.monotonic()), 0.01)
            try:
                item = self._leader.receive(wait_s) if targets is None else self._leader.receive_into(wait_s, targets)
            except BaseException:
                with contextlib.suppress(Exception):  # the others raise too instead of waiting for a task
                    channel.send_state(_FAILED)
                raise
            if item is not None:
                channel.send_state(_TASK)
                channel.send_task(item)
                return item
            if not self._leader.is_running():
                channel.send_state(_END)
                self._running = False
                return None
            if deadline is not None and time.monotonic() >= deadline:
                channel.send_state(_TIMEOUT)
                return None
            channel.send_state(_WAIT)

    # ----------------------------------------------------------------- ranks > 0

    def _follow(self, channel: TaskChannel, targets: dict[str, Any] | None) -> TaskItem | None:
        while True:
            state = channel.receive_state()
            if state == _TASK:
                return channel.receive_task(targets)
            if state == _END:
                self._running = False
                return None
            if state == _TIMEOUT:
                return None
            if state == _FAILED:
                self._running = False
                raise ClientAPIError(
                    f"rank {self.ranks.rank}: rank 0 could not receive the task from the executor (see rank 0's error)"
                )
            if state != _WAIT:
                raise ClientAPIError(f"rank {self.ranks.rank}: unknown message {state} from rank 0")

    def _default_broadcast(self) -> Callable[[Any], None]:
        """Broadcast in the default group if it runs gloo, else in a new gloo group of every rank."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ClientAPIError(
                f"rank {self.ranks.rank} of {self.ranks.world_size}: call torch.distributed.init_process_group(...) "
                "on every rank before flare.receive(); rank 0 broadcasts each task to the others"
            )
        if dist.get_world_size() != self.ranks.world_size or dist.get_rank() != self.ranks.rank:
            raise ClientAPIError(
                f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}) is not the launch's "
                f"(RANK={self.ranks.rank}, WORLD_SIZE={self.ranks.world_size}); init it over every rank"
            )
        # Tasks are CPU tensors: a gloo group carries them without a copy to a GPU (new_group is
        # collective, and so is the first receive() that calls it).
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

        def broadcast(tensor: Any) -> None:
            dist.broadcast(tensor, src=0, group=group)

        return broadcast
