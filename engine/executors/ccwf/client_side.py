"""`ClientSideController`: the client's part of a client-controlled workflow, as an executor.

It takes the server's ``<prefix>_config`` and ``<prefix>_start`` tasks (routed by ``<prefix>_*``
in the client config), does the workflow's work in threads of its own, talks to its peers over
the client job's cell, and keeps the server informed with status reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from engine.cells import Cell, Message, Reply, Status
from engine.cells.security import name_owned_by
from engine.executors.executor import Executor, ExecutorContext
from engine.model import ReservedHeaderKey, ReturnCode, Shareable, make_reply
from engine.model.ccwf import CONFIG_KEY, CONFIG_TASK, START_TASK, WorkflowStatus
from engine.streaming.codec import MessageCodec

log = logging.getLogger(__name__)

#: Header of a failed result: why it failed (as every executor sets it).
REASON_HEADER = "reason"
#: Seconds between status reports when the server's config does not say.
DEFAULT_STATUS_INTERVAL_S = 5.0


class ClientSideController(Executor):
    """Base of the client-side controllers: config and start tasks, peer cell access, status reports.

    Subclasses implement `configure` and, where the client may start the workflow,
    `start_workflow`; other ``<prefix>_<name>`` tasks go to `handle_task`.

    Args:
        task_name_prefix: The prefix of the workflow's task names, as on the server side.
    """

    def __init__(self, task_name_prefix: str) -> None:
        if not task_name_prefix:
            raise ValueError("task_name_prefix: expected a non-empty name")
        self.task_name_prefix = task_name_prefix
        self.status = WorkflowStatus(task_name_prefix)
        self.config: dict[str, Any] = {}
        self._status_lock = threading.Lock()
        self._stopped = threading.Event()
        self._reporter: threading.Thread | None = None

    # ----------------------------------------------------------------- executor

    def initialize(self, context: ExecutorContext) -> None:
        if context.cell is None or context.codec is None or context.run_task is None:
            raise RuntimeError(f"{type(self).__name__} needs a client job (a cell to reach its peers)")
        self.context = context
        self.site = context.site_name

    @property
    def cell(self) -> Cell:
        assert self.context.cell is not None
        return self.context.cell

    @property
    def codec(self) -> MessageCodec:
        assert self.context.codec is not None
        return self.context.codec

    def execute(self, task_name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        prefix = f"{self.task_name_prefix}_"
        name = task_name[len(prefix) :] if task_name.startswith(prefix) else task_name
        try:
            if name == CONFIG_TASK:
                config = shareable.get(CONFIG_KEY)
                if not isinstance(config, dict):
                    raise ValueError(f"the {task_name} task carries no config")
                self.config = config
                reply = self.configure(config) or Shareable()
                self._start_reporter(float(config.get("status_interval", DEFAULT_STATUS_INTERVAL_S)))
            elif name == START_TASK:
                reply = self.start_workflow() or Shareable()
            else:
                reply = self.handle_task(name, shareable, abort_signal)
        except Exception as e:
            log.exception("%s task failed", task_name)
            return failed(ReturnCode.EXECUTION_EXCEPTION, f"{type(e).__name__}: {e}")
        if reply.get_header(ReservedHeaderKey.RETURN_CODE) is None:
            reply.set_return_code(ReturnCode.OK)
        return reply

    def finalize(self) -> None:
        self._stopped.set()
        if self._reporter is not None:
            self._reporter.join(2.0)

    # ----------------------------------------------------------------- for subclasses

    def configure(self, config: dict[str, Any]) -> Shareable | None:
        """Take the workflow's config (check components, register peer handlers); raise if unusable."""
        return None

    def start_workflow(self) -> Shareable | None:
        """Start the workflow (only the starting client gets this)."""
        raise ValueError(f"{type(self).__name__} cannot start a workflow")

    def handle_task(self, name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        """A server task other than config and start."""
        return failed(ReturnCode.TASK_UNKNOWN, f"{type(self).__name__} has no task {name!r}")

    #: Phases a client stays in once it reached them (its later phase changes are not reported).
    final_phases: frozenset[str] = frozenset()

    def update_status(self, **changes: Any) -> None:
        """Change the status (one step of progress) and report it now."""
        with self._status_lock:
            if self.status.phase in self.final_phases:
                changes.pop("phase", None)
            for key, value in changes.items():
                setattr(self.status, key, value)
            self.status.progress += 1
        self.report_status()

    def report_status(self) -> None:
        """Send the current status to the server."""
        if self.context.report_status is None:
            return
        with self._status_lock:
            header = self.status.to_header()
        self.context.report_status(WorkflowStatus.from_header(header))

    @property
    def stopped(self) -> threading.Event:
        """Set when the job ends: worker threads stop."""
        return self._stopped

    def _start_reporter(self, interval_s: float) -> None:
        self.report_status()
        if self._reporter is not None:
            return

        def loop() -> None:
            while not self._stopped.wait(interval_s):
                self.report_status()

        self._reporter = threading.Thread(target=loop, name=f"{self.task_name_prefix}-status", daemon=True)
        self._reporter.start()


def failed(code: ReturnCode, reason: str) -> Shareable:
    """A result that says the task failed, and why."""
    reply = make_reply(code)
    reply.set_header(REASON_HEADER, reason)
    return reply


def owner_among(sender: str, sites: Sequence[str]) -> str | None:
    """The site of ``sites`` that sent a message from cell ``sender`` (itself or a child cell), or None.

    ``sender`` is a message's authenticated source: the cells layer lets a connection use only
    names its key's identity owns (`engine.cells.security.name_owned_by`).
    """
    return next((site for site in sites if site and name_owned_by(site, sender)), None)


def refused(message: Message, reason: str) -> Reply:
    """Answer a peer's message that this client does not take: log who sent it and why, reply an error.

    The job goes on as if the message never came; the sender reads ``reason`` in the reply.
    """
    log.warning("peer message refused: from=%s topic=%s reason=%s", message.source, message.topic, reason)
    return Reply(header={REASON_HEADER: reason}, status=Status.ERROR, reason=reason)
