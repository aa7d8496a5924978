"""`Executor`: what a client runs for a task, and the `ExecutorContext` the client runtime gives it."""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cells import Cell
from engine.model import Shareable
from engine.model.ccwf import WorkflowStatus
from engine.streaming.codec import MessageCodec, Placement

#: ``run_task(task_name, data, abort_signal) -> result``: another executor of this client runs a task.
TaskRunner = Callable[[str, Shareable, threading.Event], Shareable]


@dataclass(frozen=True)
class ExecutorContext:
    """Where an executor runs.

    Attributes:
        site_name: This client's name, e.g. ``site-1``.
        job_id: The running job's id.
        workspace: This site's folder of the job's workspace (logs, metrics, scratch files).
        custom_dir: The app's ``custom/`` folder (job code), if it has one.
        streaming: The client config's streaming settings (``tensor_download_chunk_size`` ...),
            for executors that move models themselves (`StreamingContext.from_config`).
        components: The client config's ``components``, by id (persistor, aggregator ...).
        cell: The client job's cell, for executors that talk to peers (client-controlled
            workflows); None outside a client job.
        codec: The cell's message codec (tensors streamed with the job's settings).
        run_task: Runs a task on whichever executor of this client the task's name routes to,
            through the task filters (a Swarm controller runs ``train`` this way).
        report_status: Sends a workflow status report to the server.
        report_metric: ``report_metric(key, value, current_round)`` sends a metric the training
            script logged to the server (numbers only; the client's ``metrics.jsonl`` keeps all).
        downloads_to_disk: ``downloads_to_disk(folder)`` is a ``with`` block inside which the
            tensors this client receives go to disk first (lazy refs); None where unsupported.
        job_sites: Every client site of the job, in the order the runtime gave them (the same
            on every site; the Client API's ``get_site_index``); empty where it gave none.
    """

    site_name: str
    job_id: str
    workspace: Path
    custom_dir: Path | None = None
    streaming: dict[str, Any] = field(default_factory=dict)
    components: Mapping[str, Any] = field(default_factory=dict)
    cell: Cell | None = None
    codec: MessageCodec | None = None
    run_task: TaskRunner | None = None
    report_status: Callable[[WorkflowStatus], None] | None = None
    report_metric: Callable[[str, Any, int | None], None] | None = None
    downloads_to_disk: Callable[[Path | None], AbstractContextManager[Any]] | None = None
    job_sites: tuple[str, ...] = ()

    def get_component(self, component_id: str, key: str = "") -> Any:
        """The component with id ``component_id``; ``key`` names the arg that asked (for errors).

        Raises:
            ValueError: The client config has no component with that id.
        """
        if component_id not in self.components:
            known = ", ".join(sorted(self.components)) or "none"
            where = f"{key}: " if key else ""
            raise ValueError(f"{where}no component with id {component_id!r} in the client config (ids: {known})")
        return self.components[component_id]


class Executor(ABC):
    """Runs tasks on a client; chosen by task name in the client config's ``executors``.

    Example:
        >>> class Echo(Executor):
        ...     def execute(self, task_name, shareable, abort_signal):
        ...         return shareable
    """

    def initialize(self, context: ExecutorContext) -> None:  # noqa: B027 - optional hook
        """Called once before the first task (start scripts, open files)."""

    @abstractmethod
    def execute(self, task_name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        """Run one task and return its result (a `Shareable` with a return code).

        Args:
            task_name: The task's name, e.g. ``train``.
            shareable: The task's data (already through the task data filters).
            abort_signal: Set when the task or the job is aborted; stop early when it is.
        """

    def task_data_placement(
        self, task_name: str, abort_signal: threading.Event
    ) -> AbstractContextManager[Placement | None]:
        """Where the tensors of the next server task ``task_name`` should land, as they arrive.

        The client runtime asks before it pulls a task's tensors for this executor, and pulls
        them inside the ``with`` block (`MessageCodec.decode` with ``place``). None (the
        default): new memory. The Client API executor answers with its script's own tensors
        when the script waits in ``flare.receive(into=...)``.
        """
        return nullcontext(None)

    def finalize(self) -> None:  # noqa: B027 - optional hook
        """Called once when the job ends (stop scripts, release resources); must not raise."""


#: Task data the client runtime handed over (see `hand_over_task_data`), by id.
_handed_over: weakref.WeakValueDictionary[int, Shareable] = weakref.WeakValueDictionary()


def hand_over_task_data(shareable: Shareable) -> Shareable:
    """Mark ``shareable`` as the executor's alone: nothing else keeps or reads it after the task.

    The client runtime does so for the task data it received from the server; an executor may
    then drop the tensors in it once it no longer needs them (the Client API executor does, once
    its script in another process has its own copy). Task data another executor runs a task
    with (a Swarm or cross-site evaluation controller) is not handed over: they keep using it.
    """
    _handed_over[id(shareable)] = shareable
    return shareable


def is_handed_over(shareable: Shareable) -> bool:
    """Whether `hand_over_task_data` marked ``shareable``."""
    return _handed_over.get(id(shareable)) is shareable
