"""Where the Client API's calls go: straight to a `TaskExchange`, or over a cell to the executor.

`InProcessBackend` serves a script that runs in a thread of the client process. A script run as
its own process gets a `SubprocessBackend`: a cell connected to the executor's local cell, with
the model's tensors pulled by the downloader in both directions.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.client.exchange import TaskExchange, TaskItem
from engine.client.into import fill_into, placement_of
from engine.errors import CellError, ClientAPIError
from engine.model import FLModel
from engine.site import ScriptCredentials, SiteEndpoint
from engine.streaming.codec import Placement

log = logging.getLogger(__name__)

#: Cell channel between a subprocess script and its executor.
API_CHANNEL = "client_api"
TOPIC_RECEIVE = "receive"
TOPIC_SEND = "send"
TOPIC_LOG = "log"
#: Environment of a subprocess script: the executor's endpoint, the site, the job, settings.
ENV_ENDPOINT = "FLENGINE_CLIENT_API_ENDPOINT"
ENV_SITE = "FLENGINE_SITE_NAME"
ENV_JOB = "FLENGINE_JOB_ID"
ENV_STREAMING = "FLENGINE_STREAMING"
#: ... and the job's client sites, in order: a JSON list of names (see `Backend.job_sites`).
ENV_JOB_SITES = "FLENGINE_JOB_SITES"
#: ... and the folder of the site's saved state (`engine.client.state`).
ENV_STATE_DIR = "FLENGINE_STATE_DIR"
#: How long one receive request waits for a task before the script asks again.
RECEIVE_POLL_S = 2.0


class Backend(ABC):
    """What the Client API functions need from the side that runs the script.

    Args:
        site_name: This client's name.
        job_id: The running job's id.
        job_sites: Every client site of the job, in the order the runtime gave them (the same on
            every site); empty where the runtime did not say.
        state_dir: The folder of the site's saved state (``flare.client_state()``); None: not known.
    """

    def __init__(
        self, site_name: str, job_id: str, job_sites: Sequence[str] = (), state_dir: Path | None = None
    ) -> None:
        self.site_name = site_name
        self.job_id = job_id
        self.job_sites = tuple(job_sites)
        self.state_dir = state_dir
        self.current: TaskItem | None = None

    @abstractmethod
    def receive(self, timeout_s: float | None) -> TaskItem | None:
        """The next task, or None when the run ended (or ``timeout_s`` passed)."""

    def receive_into(self, timeout_s: float | None, targets: dict[str, torch.Tensor]) -> TaskItem | None:
        """`receive`, with the task's weights written into ``targets`` (see `engine.client.into`).

        This default receives into new memory and copies; a backend that can place the chunks
        straight into the targets as they arrive overrides it.

        Raises:
            IntoMismatchError: The weights do not fit the targets (nothing written).
        """
        item = self.receive(timeout_s)
        return self._filled(item, targets) if item is not None else None

    def _filled(self, item: TaskItem, targets: dict[str, torch.Tensor]) -> TaskItem:
        """``item`` with its params written into ``targets``; it becomes the current task."""
        self.current = item  # a mismatch below still leaves the task taken, to be answered
        self.current = TaskItem(item.task_name, fill_into(targets, item.model))
        return self.current

    @abstractmethod
    def send(self, model: FLModel) -> None:
        """Answer the current task with ``model``."""

    @abstractmethod
    def is_running(self) -> bool:
        """False once the executor said the run is over."""

    @abstractmethod
    def log(self, key: str, value: Any) -> None:
        """Record a metric of the current task."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds."""


class InProcessBackend(Backend):
    """The Client API of a script running in a thread beside its executor.

    Args:
        exchange: The mailbox the executor puts tasks into.
        site_name: This client's name.
        job_id: The running job's id.
        on_log: Called with ``(key, value, task)`` for every `log` call.
        job_sites: Every client site of the job, in order (see `Backend`).
        state_dir: The folder of the site's saved state (see `Backend`).
    """

    def __init__(
        self,
        exchange: TaskExchange,
        site_name: str,
        job_id: str,
        on_log: Any = None,
        job_sites: Sequence[str] = (),
        state_dir: Path | None = None,
    ) -> None:
        super().__init__(site_name, job_id, job_sites, state_dir)
        self._exchange = exchange
        self._on_log = on_log

    def receive(self, timeout_s: float | None) -> TaskItem | None:
        self.current = self._exchange.take_task(timeout_s)
        return self.current

    def receive_into(self, timeout_s: float | None, targets: dict[str, torch.Tensor]) -> TaskItem | None:
        # The executor sees the targets while this waits and receives the task straight into
        # them when it can (ClientAPIExecutor.task_data_placement); fill_into then copies nothing.
        item = self._exchange.take_task(timeout_s, into=targets)
        return self._filled(item, targets) if item is not None else None

    def send(self, model: FLModel) -> None:
        self._exchange.put_result(model)

    def is_running(self) -> bool:
        return not self._exchange.ended

    def log(self, key: str, value: Any) -> None:
        if self._on_log is not None:
            self._on_log(key, value, self.current)


class SubprocessBackend(Backend):
    """The Client API of a script that runs as its own process (``execution_mode = subprocess``).

    Built by `from_environment` from the variables the executor sets when it starts the script.
    """

    def __init__(
        self,
        endpoint: str,
        site_name: str,
        job_id: str,
        streaming: dict[str, Any],
        credentials: ScriptCredentials | None = None,
        job_sites: Sequence[str] = (),
        state_dir: Path | None = None,
    ) -> None:
        super().__init__(site_name, job_id, job_sites, state_dir)
        self._endpoint = SiteEndpoint.for_script(site_name, endpoint, credentials, streaming).start()
        self._cell = self._endpoint.cell
        self._codec = self._endpoint.codec
        self._parent = site_name
        self._timeout_s = self._codec.context.per_request_timeout_s
        self._running = True
        if not self._cell.wait_connected(30.0):
            refused = self._cell.link_error
            self.close()
            if refused is not None:
                raise ClientAPIError(f"flare.init(): the executor at {endpoint} refused this script: {refused}")
            raise ClientAPIError(f"flare.init(): the executor at {endpoint} did not answer within 30 s")

    @classmethod
    def from_environment(cls) -> SubprocessBackend:
        """The backend the executor prepared, or an error saying the script is not run by flengine."""
        rank = os.environ.get("RANK", "0").strip() or "0"
        if rank != "0":
            # Under torchrun every rank inherits the executor's address and the script's keys, but
            # one connection serves the script: a second would take the first one's place.
            raise ClientAPIError(
                f"flare.init(): only rank 0 connects to the executor, this process is RANK={rank}; "
                "call flare.init() (it broadcasts the tasks to the other ranks) instead of building a backend"
            )
        endpoint = os.environ.get(ENV_ENDPOINT)
        if not endpoint:
            raise ClientAPIError(
                f"flare.init(): this script is not run by flengine ({ENV_ENDPOINT} is not set); "
                "run it through a job's ClientAPIExecutor, e.g. with `flengine run JOB`"
            )
        streaming = json.loads(os.environ.get(ENV_STREAMING, "{}"))
        credentials = ScriptCredentials.from_environment(os.environ)
        site, job = os.environ.get(ENV_SITE, "site"), os.environ.get(ENV_JOB, "job")
        state = os.environ.get(ENV_STATE_DIR)
        return cls(
            endpoint, site, job, streaming, credentials, job_sites_from_environment(os.environ),
            Path(state) if state else None,
        )  # fmt: skip

    def receive(self, timeout_s: float | None) -> TaskItem | None:
        return self._receive(timeout_s, None)

    def receive_into(self, timeout_s: float | None, targets: dict[str, torch.Tensor]) -> TaskItem | None:
        # The chunks are pulled straight into the targets when every one fits (see placement_of).
        item = self._receive(timeout_s, functools.partial(placement_of, targets=targets))
        return self._filled(item, targets) if item is not None else None

    def _receive(self, timeout_s: float | None, place: Placement | None) -> TaskItem | None:
        waited = 0.0
        while self._running:
            poll = RECEIVE_POLL_S if timeout_s is None else min(RECEIVE_POLL_S, max(timeout_s - waited, 0.01))
            reply = self._request(TOPIC_RECEIVE, {"wait_s": poll}, timeout_s=poll + self._timeout_s)
            state = reply.header.get("state")
            if state == "end":
                self._running = False
            elif state == "task":
                model = self._codec.decode(reply.frames, sender=reply.source, place=place)
                self.current = TaskItem(str(reply.header["task_name"]), model)
                return self.current
            waited += poll
            if timeout_s is not None and waited >= timeout_s:
                return None
        return None

    def send(self, model: FLModel) -> None:
        frames = self._codec.encode(model, receivers=[self._parent])
        self._request(TOPIC_SEND, {}, frames, timeout_s=self._timeout_s)
        self.current = None

    def is_running(self) -> bool:
        return self._running

    def log(self, key: str, value: Any) -> None:
        self._request(TOPIC_LOG, {"key": key, "value": value}, timeout_s=30.0)

    def close(self) -> None:
        self._running = False
        self._endpoint.close()

    def _request(self, topic: str, header: dict[str, Any], frames: list[Any] | None = None, timeout_s: float = 60.0):
        try:
            reply = self._cell.request(
                self._parent, API_CHANNEL, topic, header=header, frames=frames or (), timeout_s=timeout_s
            )
        except CellError as e:
            self._running = False
            raise ClientAPIError(f"the executor of {self.site_name} went away: {e}") from e
        if reply.header.get("error"):
            raise ClientAPIError(str(reply.header["error"]))
        return reply


def job_sites_to_environment(job_sites: Sequence[str]) -> dict[str, str]:
    """The variable that hands ``job_sites`` to a script run as its own process."""
    return {ENV_JOB_SITES: json.dumps(list(job_sites))}


def job_sites_from_environment(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The job's sites the executor put in ``environ`` (`job_sites_to_environment`); () where it put none.

    Raises:
        ClientAPIError: The variable is set but is not a JSON list of names.
    """
    text = environ.get(ENV_JOB_SITES)
    if not text:
        return ()
    try:
        sites = json.loads(text)
    except ValueError:
        sites = None
    if not isinstance(sites, list) or not all(isinstance(site, str) for site in sites):
        raise ClientAPIError(f"flare.init(): {ENV_JOB_SITES}={text[:200]!r} is not a JSON list of site names")
    return tuple(sites)


_lock = threading.Lock()
_installed: Backend | None = None
_per_thread = threading.local()


def install_backend(backend: Backend | None, this_thread_only: bool = False) -> None:
    """Make ``backend`` serve the Client API calls of this process (None removes it).

    Args:
        backend: The backend, or None.
        this_thread_only: Serve only the calling thread (a script run in a thread, so that two
            in-process executors of one client each talk to their own script).
    """
    global _installed
    if this_thread_only:
        _per_thread.backend = backend
        return
    with _lock:
        _installed = backend


def installed_backend() -> Backend | None:
    """The backend serving the calling thread's Client API calls, if any."""
    return getattr(_per_thread, "backend", None) or _installed
