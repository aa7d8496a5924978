"""`VirtualClientWorker`: a process of a simulation that runs many virtual clients, one turn at a time.

``flengine run JOB -n 10000 -t 4`` starts four of these instead of 10,000 client processes.
A worker keeps its own cell (its key, ``worker-K``) connected to the server and asks which of its
clients have a task (`protocol.TOPIC_GET_WORK`); for each it runs a *turn*: a `ClientJob` of that
client, with the client's name, workspace folder (``<workspace>/site-17``), app, filters and
executors, whose cell (the worker's key, which the server lets speak for its clients) asks for
the client's task, runs it and submits the result exactly as a client process would; one task a
turn. Its executors are finalized at the end of the turn: a
training script's loop runs once per turn, and what it keeps across rounds goes through
``flare.client_state()`` (`engine.client.state`). Torch and the job's modules stay imported
between turns; a client that is not training costs the server a record, not a process.

A client whose last result the server still holds (it may pull it again) keeps its cell open
after its turn (`MAX_PARKED` at most) until the server lets the result go or the client's next
turn begins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.config import Job
from engine.errors import CellError, SecurityError
from engine.runtime import protocol
from engine.runtime.assembly import streaming_settings
from engine.runtime.client import DEFAULT_SERVER_SILENCE_LIMIT_S, GET_TASK_TIMEOUT_S, ClientJob, ServerSilence
from engine.site import SiteEndpoint, SiteSettings

log = logging.getLogger(__name__)

#: Most client cells a worker keeps open for results the server holds; beyond, the oldest closes.
MAX_PARKED = 16


class VirtualClientWorker:
    """Runs the virtual clients ``clients`` of ``job`` as the worker ``site``.

    Args:
        job: The validated job.
        site: The worker's own settings (name ``worker-K``, keys, cell limits).
        clients: The clients this worker runs (the server's plan gives it the same).
        endpoint: The server cell's endpoint, or a callable that returns it (called once).
        workspace: The job's workspace; each client's folder is ``workspace/<client>``.
        job_id: The job's id.
        job_sites: Every client site of the job, in order (the Client API's ``get_site_index``).
        report: Progress sink, ``report(event, **fields)``; each client's events carry ``site``.
        server_silence_limit_s: How long to keep asking an unreachable server.
    """

    def __init__(
        self,
        job: Job,
        site: SiteSettings,
        clients: Sequence[str],
        endpoint: str | Callable[[], str],
        workspace: Path,
        job_id: str,
        job_sites: Sequence[str] = (),
        report: Callable[..., None] | None = None,
        server_silence_limit_s: float = DEFAULT_SERVER_SILENCE_LIMIT_S,
    ) -> None:
        if not clients:
            raise ValueError(f"{site.name}: a worker needs at least one client")
        self.job = job
        self.site = site
        self.clients = tuple(clients)
        self._mine = frozenset(clients)
        self.endpoint = endpoint
        self.workspace = workspace
        self.job_id = job_id
        self.job_sites = tuple(job_sites)
        self.server_silence_limit_s = server_silence_limit_s
        self._report = report or (lambda event, **fields: None)
        self.abort_signal = threading.Event()
        self._work_ready = threading.Event()
        self._parked: dict[str, ClientJob] = {}  # client -> its job whose result the server still holds
        self._log_filter = _TurnLogFilter()
        self.turns = 0
        self.tasks_done = 0
        self.current: ClientJob | None = None

    def run(self) -> None:
        """Run turns until the server ends the run; raise `CellError` if it stays unreachable."""
        app = self.job.app_for(self.clients[0])
        if app is None or app.client is None:
            raise ValueError(f"{self.job.folder}: no app with a config_fed_client is deployed to {self.clients[0]}")
        for handler in logging.getLogger().handlers:
            handler.addFilter(self._log_filter)
        self.network = SiteEndpoint.for_site(
            self.site,
            streaming_settings(app.client.data),
            connect_to=self._resolve_endpoint(),
            workspace=self.workspace,
        )
        cell = self.network.cell
        cell.register_handler(
            protocol.TASK_CHANNEL, protocol.TOPIC_TASK_READY, lambda message: self._work_ready.set(), inline=True
        )
        self.network.start()
        if not cell.wait_connected(self.site.cell.heartbeat_timeout_s) and cell.link_error is not None:
            raise SecurityError(self.site.describe_refusal(cell.link_error))
        log.info("worker started worker=%s clients=%d", self.site.name, len(self.clients))
        try:
            self._work_loop()
        finally:
            for client in self._parked.values():
                client.close()
            self._parked.clear()
            self.network.close()

    def _resolve_endpoint(self) -> str:
        if callable(self.endpoint):
            self.endpoint = self.endpoint()
        return self.endpoint

    def _work_loop(self) -> None:
        cell = self.network.cell
        silence = ServerSilence(self.site.name, self.server_silence_limit_s, self.network.codec.context.retry)
        while not self.abort_signal.is_set():
            self._work_ready.clear()
            try:
                reply = cell.request(
                    "server",
                    protocol.TASK_CHANNEL,
                    protocol.TOPIC_GET_WORK,
                    {protocol.HEADER_JOB_ID: self.job_id},
                    timeout_s=GET_TASK_TIMEOUT_S,
                )
            except CellError as e:
                if cell.link_error is not None:
                    raise SecurityError(self.site.describe_refusal(cell.link_error)) from e
                self.abort_signal.wait(silence.failed(e))
                continue
            silence.heard()
            state = reply.header.get("state")
            if state == protocol.STATE_END:
                log.info("server ended the run worker=%s turns=%d tasks_done=%d", self.site.name, self.turns,
                         self.tasks_done)  # fmt: skip
                return
            self._close_released()
            ready = self._ready_clients(reply.header.get("clients")) if state == protocol.STATE_TASK else []
            for client in ready:
                if self.abort_signal.is_set():
                    return
                self._turn(client)
            silence.heard()
            if not ready:
                self._work_ready.wait(float(reply.header.get("retry_s", protocol.DEFAULT_RETRY_S)))

    def _ready_clients(self, listed: Any) -> list[str]:
        """The server's list of clients with work, kept to this worker's own."""
        if not isinstance(listed, list):
            log.warning("work reply ignored: clients is a %s, not a list", type(listed).__name__)
            return []
        ready = [name for name in listed if isinstance(name, str) and name in self._mine]
        if len(ready) != len(listed):
            log.warning(
                "work reply named clients of another worker; ignored: %s", [n for n in listed if n not in ready][:5]
            )
        return ready

    def _turn(self, name: str) -> None:
        """Run ``name``'s tasks now, as that client."""
        parked = self._parked.pop(name, None)
        if parked is not None:  # a new task: the server is done with the last result
            parked.close()
        folder = self.workspace / name
        folder.mkdir(parents=True, exist_ok=True)
        site = dataclasses.replace(self.site, name=name, key_name=self.site.name)
        client = ClientJob(
            self.job,
            site,
            self.endpoint,
            folder,
            self.job_id,
            server_silence_limit_s=self.server_silence_limit_s,
            report=lambda event, **fields: self._report(event, site=name, **fields),
            job_sites=self.job_sites,
            turn=True,
        )
        client.abort_signal = self.abort_signal  # the worker's stop is every turn's
        self.current, self._log_filter.site = client, name
        home = os.getcwd()
        os.chdir(folder)  # a script's relative paths land in its own client's folder, as in a client process
        try:
            client.run()
        except Exception:  # one client's failure (its script's, say) is its own: the worker goes on
            log.exception("turn failed site=%s", name)
        finally:
            os.chdir(home)
            self.current, self._log_filter.site = None, None
            self.turns += 1
            self.tasks_done += client.tasks_done
        if getattr(client, "network", None) is not None and client.holding():
            self._parked[name] = client
            while len(self._parked) > MAX_PARKED:
                oldest = next(iter(self._parked))
                log.warning("result of %s no longer held open: %d clients wait for the server", oldest, MAX_PARKED)
                self._parked.pop(oldest).close()

    def _close_released(self) -> None:
        """Close the cells of clients whose results the server let go."""
        for name in [name for name, client in self._parked.items() if not client.holding()]:
            self._parked.pop(name).close()


class _TurnLogFilter(logging.Filter):
    """Prefixes each log record of the worker's process with the client whose turn it is."""

    def __init__(self) -> None:
        super().__init__()
        self.site: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        site = self.site
        if site is not None and not getattr(record, "turn_site", None):
            record.turn_site = site
            record.msg = f"[{site}] {record.msg}"
        return True
