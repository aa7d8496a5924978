"""`Executor`: what a client runs for a task, and the `ExecutorContext` the client runtime gives it."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cells import Cell
from engine.model import Shareable
from engine.model.ccwf import WorkflowStatus
from engine.streaming.codec import MessageCodec

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
        downloads_to_disk: ``downloads_to_disk(folder)`` is a ``with`` block inside which the
            tensors this client receives go to disk first (lazy refs); None where unsupported.
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
    downloads_to_disk: Callable[[Path | None], AbstractContextManager[Any]] | None = None

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

    def finalize(self) -> None:  # noqa: B027 - optional hook
        """Called once when the job ends (stop scripts, release resources); must not raise."""
