"""`ClientJob`: the client side of a running job.

It builds the client app's executors and filters, connects its cell to the server, and pulls:
ask for a task, pull its tensors, filter, run the executor the task's name routes to, filter the
result and submit it (the server pulls its tensors), until the server says END_RUN. When the
server cannot be reached it keeps asking (the cell reconnects) for ``server_silence_limit_s``,
with the backoff of ``streaming_retry_backoff_s``, and a repeated task request carries the same
request id, so a task whose answer was lost comes again; a result lost to a timeout or a
dropped connection is submitted again up to ``streaming_retries`` times.
"""

from __future__ import annotations

import fnmatch
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from engine.cells import Message
from engine.cells.retry import RetryPolicy, request_with_retries
from engine.config import Job
from engine.errors import CellError, CellRemoteError, SecurityError
from engine.executors.client_api import REASON_HEADER
from engine.executors.executor import ExecutorContext, hand_over_task_data
from engine.metrics.rules import is_metric_value
from engine.model import ReservedHeaderKey, ReturnCode, Shareable, make_reply, shown_round
from engine.model.ccwf import CCWF_CHANNEL, TOPIC_STATUS, WorkflowStatus
from engine.model.payload import payload_bytes
from engine.paths import JobPaths
from engine.runtime import protocol
from engine.runtime.assembly import (
    FilterChains,
    FilterError,
    build_entries,
    build_executors,
    configure_tensor_pool,
    prepare_components,
    prepare_executors,
    route_task,
    streaming_settings,
)
from engine.site import SiteEndpoint, SiteSettings
from engine.streaming.codec import Placement

log = logging.getLogger(__name__)

#: Seconds a client keeps trying to reach a server that does not answer before it gives up.
DEFAULT_SERVER_SILENCE_LIMIT_S = 60.0
#: Longest wait for the answer to one task request, in seconds.
GET_TASK_TIMEOUT_S = 30.0
#: Longest pause between two task requests that failed, in seconds (the backoff doubles up to it).
GET_TASK_MAX_WAIT_S = 5.0


class ClientJob:
    """Runs the client app of ``job`` as ``site``, against the server at ``endpoint``.

    Args:
        job: The validated job.
        site: This client's own settings (its name, e.g. ``site-1``, keys, cell limits).
        endpoint: The server cell's endpoint, ``tcp://host:port``, or a callable that returns it,
            called once the executors are built (a client started before its server listens).
        workspace: This client's folder of the job's workspace.
        job_id: The job's id.
        server_silence_limit_s: How long to keep asking an unreachable server.
        report: Progress sink, ``report(event, **fields)``: ``task_received`` (task, task_id,
            round, bytes, seconds: the task's download) and ``task_done`` (task, task_id, round,
            seconds: since the task arrived, before its result is sent).
        job_sites: Every client site of the job, in the same order on every site (what the
            Client API's ``get_site_index`` counts in); it must name ``site``. Empty: not known.
        turn: A virtual client's turn (a simulation's worker runs it, `engine.runtime.worker`):
            run one task the server has for this client now (none if it says "wait"), then return;
            its cell stays open while the server holds its last result (`holding`, `close`).
    """

    def __init__(
        self,
        job: Job,
        site: SiteSettings,
        endpoint: str | Callable[[], str],
        workspace: Path,
        job_id: str,
        server_silence_limit_s: float = DEFAULT_SERVER_SILENCE_LIMIT_S,
        report: Callable[..., None] | None = None,
        job_sites: Sequence[str] = (),
        turn: bool = False,
    ) -> None:
        app = job.app_for(site.name)
        if app is None or app.client is None:
            raise ValueError(f"{job.folder}: no app with a config_fed_client is deployed to {site.name}")
        if job_sites and site.name not in job_sites:
            raise ValueError(f"job_sites {list(job_sites)} do not name this site {site.name!r}")
        self.app = app
        self.job_folder = job.folder
        self.site_settings = site
        self.site = site.name
        self.endpoint = endpoint
        self.workspace = workspace
        self.job_id = job_id
        self.job_sites = tuple(job_sites)
        self.server_silence_limit_s = server_silence_limit_s
        self.turn = turn
        self._report = report or (lambda event, **fields: None)
        self.abort_signal = threading.Event()
        self._task_ready = threading.Event()  # set by the server's notice that a task is scheduled
        self._held_results: list[str] = []  # offers of the last result, held for the server
        self.tasks_done = 0
        self.chunks_served = 0

    def run(self) -> None:
        """Pull and run tasks until END_RUN; raise `CellError` if the server stays unreachable."""
        document = self.app.client
        config = document.data
        if self.app.custom_dir is not None and self.app.custom_dir.is_dir():
            custom = str(self.app.custom_dir.resolve())
            if custom not in sys.path:  # a worker runs many turns of the same app
                sys.path.insert(0, custom)
        self.settings = streaming_settings(config)
        configure_tensor_pool(config)
        components = build_entries(document, "components")
        paths = JobPaths(self.app.folder, self.job_folder, self.workspace, self.site_settings.allowed_dirs)
        prepare_components(components, document, self.workspace, paths)
        routes = build_executors(document)
        prepare_executors(routes, document, paths)
        data_filters = FilterChains.build(document, "task_data_filters")
        result_filters = FilterChains.build(document, "task_result_filters")
        self.network = SiteEndpoint.for_site(
            self.site_settings, self.settings, connect_to=self._resolve_endpoint(), workspace=self.workspace
        )
        self.cell = self.network.cell
        self.cell.register_handler(
            protocol.TASK_CHANNEL, protocol.TOPIC_TASK_READY, lambda message: self._task_ready.set(), inline=True
        )
        self.network.start()
        self.codec = self.network.codec
        if not self.cell.wait_connected(self.site_settings.cell.heartbeat_timeout_s):  # else the pull loop retries
            self._check_not_refused()
        self._current_round = None
        # An app without custom/ still confines task scripts to where custom/ would be: a job may not
        # run a script it does not bring (one of the site's own Python files, say).
        custom_dir = self.app.custom_dir if self.app.custom_dir is not None else self.app.folder / "custom"
        context = ExecutorContext(
            self.site,
            self.job_id,
            self.workspace,
            custom_dir,
            dict(self.settings),
            components=components,
            cell=self.cell,
            codec=self.codec,
            run_task=lambda name, data, abort: self._run_local_task(
                name, data, abort, routes, data_filters, result_filters
            ),
            report_status=self._report_status,
            report_metric=self._report_metric,
            downloads_to_disk=self.network.downloads_to_disk,
            job_sites=self.job_sites,
        )
        if self.turn:
            log.info("turn of site=%s", self.site)
        elif self.job_sites:  # which shard a script takes by get_site_index: worth a line in the site's log
            index = self.job_sites.index(self.site)
            sites = ",".join(self.job_sites)
            log.info("job sites site=%s index=%d of=%d sites=%s", self.site, index, len(self.job_sites), sites)
        else:
            log.info("job sites unknown site=%s (started without --clients)", self.site)
        started = []
        try:
            for route in routes:
                route.executor.initialize(context)
                started.append(route.executor)
            self._pull_loop(routes, data_filters, result_filters)
        finally:
            for executor in started:
                try:
                    executor.finalize()
                except Exception:
                    log.exception("executor finalize failed executor=%s", type(executor).__name__)
            for component_id, component in components.items():
                try:
                    if callable(getattr(component, "flush", None)):
                        component.flush()
                except Exception:
                    log.exception("component could not finish its writes component=%s", component_id)
            if not (self.turn and self.holding()):
                self.close()

    def holding(self) -> bool:
        """Whether the server still holds this client's last result (it may pull it once more)."""
        service = self.network.service
        return bool(self._held_results) and service is not None and service.open_offers() > 0

    def close(self) -> None:
        """Close this client's cell (`run` does, unless a turn ends while its result is held)."""
        self.chunks_served = self.network.chunks_served
        self.network.close()

    def _resolve_endpoint(self) -> str:
        if callable(self.endpoint):
            self.endpoint = self.endpoint()
        return self.endpoint

    def _run_local_task(
        self,
        task_name: str,
        data: Shareable,
        abort_signal: threading.Event,
        routes: list[Any],
        data_filters: FilterChains,
        result_filters: FilterChains,
    ) -> Shareable:
        """Run a task that did not come from the server (a peer's, or a controller's own) on this client."""
        data.set_header(ReservedHeaderKey.TASK_NAME, task_name)
        result = self._dispatch(task_name, data, abort_signal, routes, data_filters)
        try:
            return result_filters.apply(task_name, result, self.site)
        except FilterError as e:
            return _failed(ReturnCode.EXECUTION_EXCEPTION, str(e))

    def _dispatch(
        self,
        task_name: str,
        data: Shareable,
        abort_signal: threading.Event,
        routes: list[Any],
        data_filters: FilterChains,
    ) -> Shareable:
        """Run ``data`` through the data filters and the executor ``task_name`` routes to."""
        executor = route_task(routes, task_name)
        if executor is None:
            return _failed(ReturnCode.TASK_UNKNOWN, f"no executor of {self.site} handles task {task_name!r}")
        try:
            data = data_filters.apply(task_name, data, self.site)
            return executor.execute(task_name, data, abort_signal)
        except FilterError as e:
            return _failed(ReturnCode.BAD_TASK_DATA, str(e))
        except Exception as e:
            log.exception("executor failed task=%s", task_name)
            return _failed(ReturnCode.EXECUTION_EXCEPTION, f"{type(e).__name__}: {e}")

    def _report_metric(self, key: str, value: Any, current_round: int | None) -> None:
        """Send one number the training script logged to the server, fire and forget (others stay local)."""
        if not is_metric_value(value):
            return
        header = {
            protocol.HEADER_JOB_ID: self.job_id,
            "key": str(key),
            "value": float(value),
            "round": current_round if isinstance(current_round, int) else None,
        }
        try:
            self.cell.send("server", protocol.METRICS_CHANNEL, protocol.TOPIC_METRIC, header=header)
        except CellError as e:  # a metric is not worth failing a task for
            log.debug("metric not sent key=%s: %s", key, e)

    def _report_status(self, status: WorkflowStatus) -> None:
        try:
            self.cell.send("server", CCWF_CHANNEL, TOPIC_STATUS, header=status.to_header())
        except CellError as e:
            log.warning("status report not sent: %s", e)

    def _check_not_refused(self) -> None:
        """Raise `SecurityError` when the server refused this site (wrong keys): retrying cannot help."""
        error = self.cell.link_error
        if error is not None:
            raise SecurityError(self.site_settings.describe_refusal(error))

    def _pull_loop(self, routes: list[Any], data_filters: FilterChains, result_filters: FilterChains) -> None:
        silence = ServerSilence(self.site, self.server_silence_limit_s, self.codec.context.retry)
        request_id = uuid.uuid4().hex  # kept while asking again: a repeat gets the first one's task
        while not self.abort_signal.is_set():
            self._task_ready.clear()  # a notice from now on cuts the next wait short
            try:
                reply = self.cell.request(
                    "server",
                    protocol.TASK_CHANNEL,
                    protocol.TOPIC_GET_TASK,
                    {protocol.HEADER_JOB_ID: self.job_id, protocol.HEADER_REQUEST_ID: request_id},
                    timeout_s=GET_TASK_TIMEOUT_S,
                )
            except CellError as e:
                self._check_not_refused()
                wait_s = silence.failed(e)
                if self.cell.connected:
                    self.abort_signal.wait(wait_s)
                else:  # the cell reconnects by itself: ask as soon as it has
                    self.cell.wait_connected(wait_s)
                continue
            silence.heard()
            request_id = uuid.uuid4().hex
            state = reply.header.get("state")
            if state == protocol.STATE_END:
                log.info("server ended the run tasks_done=%d", self.tasks_done)
                return
            if state == protocol.STATE_TASK:
                self._run_task(reply, routes, data_filters, result_filters)
                silence.heard()
                if self.turn:  # one task a turn: the script's loop runs afresh for each task
                    return
            elif self.turn:  # nothing for this virtual client now: its worker goes on with the next
                return
            else:
                self._task_ready.wait(float(reply.header.get("retry_s", protocol.DEFAULT_RETRY_S)))

    def _run_task(
        self, reply: Message, routes: list[Any], data_filters: FilterChains, result_filters: FilterChains
    ) -> None:
        task_name = str(reply.header["task_name"])
        task_id = str(reply.header["task_id"])
        self._let_go_of_results()  # a new task: the server is done with the last result
        started = time.monotonic()
        result = self._execute(task_name, task_id, reply, routes, data_filters)
        if self._current_round is not None:  # result filters see the round (GaussianPrivacy's accounting)
            result.set_header(ReservedHeaderKey.CURRENT_ROUND, self._current_round)
        try:
            result = result_filters.apply(task_name, result, self.site)
        except FilterError as e:
            log.warning("result filter failed task=%s: %s", task_name, e)
            result = _failed(ReturnCode.EXECUTION_EXCEPTION, str(e))
        result.set_header(ReservedHeaderKey.TASK_NAME, task_name)
        result.set_header(ReservedHeaderKey.TASK_ID, task_id)
        if self._current_round is not None:
            result.set_header(ReservedHeaderKey.CURRENT_ROUND, self._current_round)
        self._report("task_done", task=task_name, task_id=task_id, round=shown_round(self._current_round),
                     seconds=round(time.monotonic() - started, 4))  # fmt: skip
        log.info(
            "task done task=%s id=%s rc=%s seconds=%.2f",
            task_name,
            task_id,
            result.get_return_code().value,
            time.monotonic() - started,
        )
        self._submit(task_name, task_id, result)
        self.tasks_done += 1

    def _execute(
        self, task_name: str, task_id: str, reply: Message, routes: list[Any], data_filters: FilterChains
    ) -> Shareable:
        self._current_round = None
        try:
            # An in-process script waiting in flare.receive(into=net) gets the tensors in net's own.
            with self._placement(task_name, routes, data_filters) as place:
                started = time.monotonic()
                data = self.codec.decode(reply.frames, sender=reply.source, place=place, stop=self.abort_signal)
            if not isinstance(data, Shareable):
                raise TypeError(f"task data must be a Shareable, got {type(data).__name__}")
        except Exception as e:
            log.warning("task data could not be received task=%s: %s", task_name, e)
            return _failed(ReturnCode.BAD_TASK_DATA, f"task data could not be received: {e}")
        hand_over_task_data(data)  # nothing here keeps it: the executor may drop its tensors
        self._report(
            "task_received", task=task_name, task_id=task_id,
            round=shown_round(data.get_header(ReservedHeaderKey.CURRENT_ROUND)),
            bytes=payload_bytes(data), seconds=round(time.monotonic() - started, 4),
        )  # fmt: skip
        data.set_header(ReservedHeaderKey.TASK_NAME, task_name)
        data.set_header(ReservedHeaderKey.TASK_ID, task_id)
        self._current_round = data.get_header(ReservedHeaderKey.CURRENT_ROUND)
        return self._dispatch(task_name, data, self.abort_signal, routes, data_filters)

    def _placement(
        self, task_name: str, routes: list[Any], data_filters: FilterChains
    ) -> AbstractContextManager[Placement | None]:
        """Where the task's tensors land: the executor's say, unless a data filter sees them first."""
        executor = route_task(routes, task_name)
        filtered = any(
            filters and any(fnmatch.fnmatchcase(task_name, pattern) for pattern in patterns)
            for patterns, filters in data_filters.chains
        )
        if executor is None or filtered:
            return nullcontext(None)
        return executor.task_data_placement(task_name, self.abort_signal)

    def _let_go_of_results(self) -> None:
        """Free the results the server held (see `_submit`); it will not pull them again."""
        held, self._held_results = self._held_results, []
        if held and self.network.service is not None:
            self.network.service.drop(held)

    def _submit(self, task_name: str, task_id: str, result: Shareable) -> None:
        offers: list[str] = []
        frames = self.codec.encode(result, receivers=["server"], offers=offers)
        del result
        # The server replies once it has pulled every tensor; each pull is bounded by the
        # per-request timeout, and a server that dies fails the request as unreachable at once.
        # A submit lost to a timeout or a dropped connection is sent again (the server answers a
        # repeat with the first one's answer, see `engine.runtime.repeats`); its offers stay.
        timeout_s = max(self.codec.context.per_request_timeout_s * 10, 60.0)
        try:
            reply = request_with_retries(
                self.cell,
                "server",
                protocol.TASK_CHANNEL,
                protocol.TOPIC_SUBMIT,
                header={
                    "task_id": task_id,
                    "task_name": task_name,
                    protocol.HEADER_JOB_ID: self.job_id,
                    protocol.HEADER_REQUEST_ID: uuid.uuid4().hex,
                },
                frames=frames,
                timeout_s=timeout_s,
                policy=self.codec.context.retry,
                stop=self.abort_signal,
            )
            log.info("result submitted task=%s outcome=%s", task_name, reply.header.get("outcome"))
            if reply.header.get("held") is True and self.network.service is not None:
                # The server folded it into its sum and may pull it once more (if another site's
                # result fails midway): served until it says done, or this site's next task.
                self.network.service.hold(offers)
                self._held_results = offers
        except CellRemoteError as e:
            log.warning("the server refused the result of task=%s: %s", task_name, e)
        except CellError as e:
            log.warning("result of task=%s not delivered: %s", task_name, e)


class ServerSilence:
    """How long a client (or a simulation's worker) has gone without an answer from the server.

    Args:
        who: The asking site, for the error.
        limit_s: How long to keep asking an unreachable server.
        retry: The job's retry policy: the wait before each next ask grows with the failures.
    """

    def __init__(self, who: str, limit_s: float, retry: RetryPolicy) -> None:
        self.who = who
        self.limit_s = limit_s
        self.retry = retry
        self.heard()

    def heard(self) -> None:
        """The server answered."""
        self._last_heard = time.monotonic()
        self._failures = 0

    def failed(self, error: CellError) -> float:
        """An ask failed with ``error``: the seconds to wait before the next (at most `GET_TASK_MAX_WAIT_S`).

        Raises:
            CellError: The server has not answered for longer than the limit.
        """
        silent_s = time.monotonic() - self._last_heard
        if silent_s > self.limit_s:
            raise CellError(f"{self.who}: the server did not answer for {silent_s:.0f} s ({error})") from error
        self._failures += 1
        wait_s = min(self.retry.wait_s(self._failures), GET_TASK_MAX_WAIT_S)
        log.warning("server not reachable, retrying in %.2f s: %s", wait_s, error)
        return wait_s


def _failed(code: ReturnCode, reason: str) -> Shareable:
    reply = make_reply(code)
    reply.set_header(REASON_HEADER, reason)
    return reply
