"""`JobContext`: what a workflow may use of the job it runs in (components, workspace, progress)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from engine.model.ccwf import WorkflowStatus

T = TypeVar("T")


def _ignore(event: str, **fields: Any) -> None:
    """The default progress sink: drops every event."""


class DiskDownloadArea(Protocol):
    """Where received tensors go while a workflow downloads to disk."""

    folder: Path | None
    downloads: int  # streams downloaded to disk so far

    def bytes_used(self) -> int:
        """Bytes of downloaded files in the folder now."""


@dataclass(frozen=True)
class ReceivedStatus:
    """A client's status report and when it arrived (``time.monotonic()`` on the server)."""

    received: float
    status: WorkflowStatus


@dataclass
class JobContext:
    """The job around a workflow, given to it by the server runtime before ``run()``.

    Attributes:
        job_id: The running job's id.
        workspace: The server's folder of the job's workspace (models, logs).
        components: The server config's ``components``, by id.
        report: Progress sink, ``report(event, **fields)``; events a workflow reports:
            ``round_started`` (round, total_rounds), ``round_done`` (round, time_s, metrics,
            clients), and ``workflow_note`` (message).
        settings: The server config's engine settings (streaming chunk sizes and timeouts).
        disk_downloads: The runtime's switch for downloads to disk (see `downloads_to_disk`);
            None where the runtime has none.
        status_reports: The clients' latest status reports of a client-controlled workflow
            (see `client_status`); None where the runtime has none.
        dead_clients: The clients the runtime found dead (their process ended, or no heartbeat
            within the heartbeat timeout), with why (site -> reason); None where it has none.
        checkpoint_dir: Where the workflow keeps what it needs to resume (see
            `engine.workflows.checkpoint`); None: it keeps nothing.
        resuming: The job was stopped and runs again: the workflow resumes from its checkpoint.
    """

    job_id: str = "job"
    workspace: Path = field(default_factory=Path.cwd)
    components: Mapping[str, Any] = field(default_factory=dict)
    report: Callable[..., None] = _ignore
    settings: Mapping[str, Any] = field(default_factory=dict)
    disk_downloads: Callable[[Path | None], AbstractContextManager[DiskDownloadArea]] | None = None
    status_reports: Callable[[str], Mapping[str, ReceivedStatus]] | None = None
    dead_clients: Callable[[], Mapping[str, str] | set[str]] | None = None
    checkpoint_dir: Path | None = None
    resuming: bool = False

    def client_status(self, workflow: str) -> dict[str, ReceivedStatus]:
        """The latest status report of each client for ``workflow`` (a task name prefix), by site."""
        return {} if self.status_reports is None else dict(self.status_reports(workflow))

    def dead(self) -> set[str]:
        """The clients found dead now (a client that came back is no longer)."""
        return set() if self.dead_clients is None else set(self.dead_clients())

    def dead_reasons(self) -> dict[str, str]:
        """The clients found dead now, with why each is (``"dead"`` where the runtime gives no reason)."""
        dead = {} if self.dead_clients is None else self.dead_clients()
        return dict(dead) if isinstance(dead, Mapping) else {client: "dead" for client in dead}

    def downloads_to_disk(self, folder: Path | None = None) -> AbstractContextManager[DiskDownloadArea]:
        """A ``with`` block inside which the tensors of received results go to disk first.

        Results then carry lazy refs (``resolve()`` reads one tensor) instead of tensors; the
        previous behaviour returns when the block ends, and the block's folder is deleted.

        Args:
            folder: Where the downloads go; the runtime's default (under the workspace) if None.

        Raises:
            RuntimeError: The runtime running this workflow cannot download to disk.
        """
        if self.disk_downloads is None:
            raise RuntimeError("download_to_disk: this runtime cannot download to disk")
        return self.disk_downloads(folder)

    def get_component(self, component_id: str, expected: type[T] | None = None, key: str = "") -> T:
        """The component with id ``component_id``; ``key`` names the arg that asked (for errors).

        Raises:
            ValueError: No component has that id, or it is not an ``expected``.
        """
        where = f"{key}: " if key else ""
        if component_id not in self.components:
            known = ", ".join(sorted(self.components)) or "none"
            raise ValueError(f"{where}no component with id {component_id!r} in the server config (ids: {known})")
        component = self.components[component_id]
        if expected is not None and not isinstance(component, expected):
            raise ValueError(
                f"{where}component {component_id!r} is a {type(component).__name__}, expected a {expected.__name__}"
            )
        return component
