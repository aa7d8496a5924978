"""`Executor`: what a client runs for a task, and the `ExecutorContext` the client runtime gives it."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model import Shareable


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
    """

    site_name: str
    job_id: str
    workspace: Path
    custom_dir: Path | None = None
    streaming: dict[str, Any] = field(default_factory=dict)


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
