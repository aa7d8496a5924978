"""`ServerJob`: the server side of a running job.

It builds the server app's components and workflows, opens the server cell, and answers the
clients: ``get`` hands out the next task the controller's queue has for that client (serialized
once per task and pulled by every client from the same downloadable), ``submit`` pulls a result
and gives it to the queue. A monitor thread applies task timeouts and turns clients that stopped
heartbeating into CLIENT_DEAD. The workflows run one after the other in the calling thread.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.cells import Message, Reply, Status
from engine.cells.log_limit import REFUSALS
from engine.config import Job
from engine.controller import Controller, SubmitOutcome, TaskQueue
from engine.controller.context import JobContext, ReceivedStatus
from engine.errors import CellError, CheckpointError
from engine.fault_points import fault_point
from engine.metrics import MetricsIntake
from engine.model import DXO, FLModel, ReservedHeaderKey, Shareable, shown_round
from engine.model.ccwf import CCWF_CHANNEL, TOPIC_STATUS, WorkflowStatus
from engine.model.payload import payload_bytes
from engine.paths import JobPaths
from engine.runtime import protocol
from engine.runtime.assembly import (
    FilterChains,
    build_entries,
    configure_tensor_pool,
    prepare_components,
    streaming_settings,
)
from engine.runtime.job_end import JobOutcome, end_of_run_warnings, flush_components
from engine.runtime.liveness import SiteLiveness
from engine.runtime.process import EVENTS_FILE
from engine.runtime.repeats import RepeatedRequests
from engine.runtime.result_intake import ResultIntake
from engine.runtime.site_deaths import SiteDeaths
from engine.runtime.stalls import DEFAULT_FOLD_WAIT_S, StallWatch
from engine.runtime.states import JobState
from engine.runtime.transfer_progress import DownloadProgress
from engine.runtime.worker_host import WorkerHost
from engine.runtime.workflow_progress import CHECKPOINT_FOLDER, PROGRESS_FILE, WorkflowProgress, earlier_rounds
from engine.site import SiteEndpoint, SiteSettings

log = logging.getLogger(__name__)

#: Seconds between the monitor's checks of task timeouts and client liveness.
MONITOR_INTERVAL_S = 0.2
#: Seconds the server waits, after the last workflow, for every live client to hear END_RUN.
END_RUN_GRACE_S = 15.0
#: Seconds the server waits for every client to ask for work before the first workflow starts.
CLIENTS_READY_TIMEOUT_S = 120.0


class ServerJob(ResultIntake, WorkerHost, SiteDeaths):
    """Runs the server app of ``job`` for ``clients``.

    Args:
        job: The validated job.
        site: The server's own settings (name, keys, cell limits).
        workspace: The server's folder of the job's workspace.
        clients: The names of the clients that take part (``site-1`` ...).
        job_id: The job's id, as the clients will see it.
        report: Progress sink, ``report(event, **fields)``.
        resume: The job ran before and its server stopped: workflows that completed are not run
            again, the one that was running resumes from its checkpoint (`WorkflowProgress`).
        workers: A simulation's virtual clients: worker -> the clients it runs (`WorkerHost`);
            each worker's key may register its clients' cells. Empty: every client is its own process.
    """

    def __init__(
        self,
        job: Job,
        site: SiteSettings,
        workspace: Path,
        clients: list[str],
        job_id: str,
        report: Any = None,
        resume: bool = False,
        workers: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        app = job.app_for("server")
        if app is None or app.server is None:
            raise ValueError(f"{job.folder}: no app with a config_fed_server is deployed to the server")
        self.job = job
        self.app = app
        self.site = site
        self.workspace = workspace
        self.clients = clients
        self.job_id = job_id
        self.resume = resume
        self.progress = WorkflowProgress(workspace / CHECKPOINT_FOLDER / PROGRESS_FILE)
        self.abort_signal = threading.Event()
        # A resumed job's summary holds the rounds played before the server stopped too.
        self.rounds: list[dict[str, Any]] = earlier_rounds(workspace / EVENTS_FILE) if resume else []
        self._earlier = {id(record) for record in self.rounds}  # the earlier run's: a replayed round replaces them
        self._report = report or (lambda event, **fields: None)
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self.workers = {worker: list(names) for worker, names in (workers or {}).items()}
        self._seen_workers: set[str] = set()
        self.liveness = SiteLiveness(clients)
        self._told_end: set[str] = set()
        self._task_frames: dict[int, tuple[Any, list[Any]]] = {}
        self._offers_of_task: dict[int, list[str]] = {}  # id(task) -> ref ids of its task data's downloads
        self._delivered: dict[int, set[str]] = {}  # id(task) -> the clients its shared frames went to
        # client task id -> its client, and the downloads of the data it was sent
        self._task_offers: dict[str, tuple[str, list[str]]] = {}
        self._stopped = threading.Event()
        self._memory_slot = threading.Lock()
        self._status: dict[str, dict[str, ReceivedStatus]] = {}  # workflow -> site -> its latest report
        self._status_workflows: frozenset[str] = frozenset()  # the names of reports kept: the workflows'
        self._sent_bytes: dict[str, tuple[str, int]] = {}  # task id -> (site, bytes of the model sent)
        self._metrics: MetricsIntake | None = None
        self.chunks_served = 0
        self._downloads = DownloadProgress()  # the models clients are pulling, for progress events
        self._fold_wait_s = float(app.server.data.get("fold_wait_s", DEFAULT_FOLD_WAIT_S))
        self._stalls = StallWatch()

    def report(self, event: str, **fields: Any) -> None:
        """Forward a progress event (its ``round`` counted from 1), keeping the rounds for the job's summary."""
        if event == "round_done" and self._metrics is not None:  # the global model's metrics, e.g. TensorBoard
            self._metrics.from_server(fields.get("metrics"), fields.get("round"))
        fields = _one_based_round(fields)
        if event == "round_done" and self._stalls.stalled():  # sites that keep leaving their task unpulled
            fields["stalled"] = self._stalls.stalled()
        if event == "round_done":  # a round played again after a resume replaces the earlier record
            while (
                self.rounds
                and id(self.rounds[-1]) in self._earlier
                and self.rounds[-1].get("round", 0) >= fields.get("round", 0)
            ):
                self.rounds.pop()
            if fields.get("played_again") and self.rounds and self.rounds[-1].get("round") == fields.get("round"):
                self.rounds.pop()  # a Swarm round done, then played again after its aggregation client was lost
            self.rounds.append(fields)
        self._report(event, **fields)

    def run(self) -> JobOutcome:
        """Run every workflow of the server config; return how the job ended."""
        document = self.app.server
        config = document.data
        if self.app.custom_dir is not None and self.app.custom_dir.is_dir():
            sys.path.insert(0, str(self.app.custom_dir.resolve()))
        components = build_entries(document, "components")
        workflows = build_entries(document, "workflows")
        self._status_workflows = frozenset(
            name for workflow in workflows.values() if (name := getattr(workflow, "status_workflow", None)) is not None
        )
        self._data_filters = FilterChains.build(document, "task_data_filters")
        self._result_filters = FilterChains.build(document, "task_result_filters")
        paths = JobPaths(self.app.folder, self.job.folder, self.workspace, self.site.allowed_dirs)
        prepare_components(components, document, self.workspace, paths)
        prepare_components(workflows, document, self.workspace, paths, key="workflows")
        self._metrics = MetricsIntake.for_components(components, self.workspace, self.clients, self.site.name)

        settings = streaming_settings(config)
        configure_tensor_pool(config)
        self.endpoint = SiteEndpoint.for_site(self.site, settings, workspace=self.workspace)
        allowlist = self.endpoint.cell.allowlist
        revoked = self.liveness.revoked()  # told before the job listened
        if allowlist is not None and self.workers:  # virtual clients: their workers' keys speak for them
            allowlist.keep_only(set(self.workers))
            allowlist.delegate({worker: set(names) - revoked for worker, names in self.workers.items()})
        elif allowlist is not None:  # the job's port lets in the job's own sites only, none revoked
            allowlist.keep_only({client.split(".", 1)[0] for client in self.clients} - revoked)
        self.endpoint.start()
        self.cell = self.endpoint.cell
        self.codec = self.endpoint.codec
        # A pull from a site known dead (its process ended) is not asked again: it fails at once.
        context = self.codec.context
        self.codec.context = dataclasses.replace(context, retry=dataclasses.replace(context.retry, gone=self._gone))
        self.queue = TaskQueue(self.clients)
        self.liveness.attach(self.queue)
        self.queue.set_schedule_listener(self._tell_task_ready)
        # A client asks again after a timeout or a lost connection: a repeat gets the first answer.
        # Cells that are not the job's clients are refused first: they leave nothing in its memory.
        self.repeats = repeats = RepeatedRequests(
            self.queue.expects_result, 10 * self.codec.context.per_request_timeout_s
        )
        get_task, submit = repeats.get_task(self._on_get_task), repeats.submit(self._on_submit)
        self.cell.register_handler(protocol.TASK_CHANNEL, protocol.TOPIC_GET_TASK, self._clients_only(get_task))
        self.cell.register_handler(protocol.TASK_CHANNEL, protocol.TOPIC_SUBMIT, self._clients_only(submit))
        self.cell.register_handler(CCWF_CHANNEL, TOPIC_STATUS, self._on_status)
        if self.workers:
            self.cell.register_handler(protocol.TASK_CHANNEL, protocol.TOPIC_GET_WORK, self._on_get_work)
        self.cell.register_handler(protocol.METRICS_CHANNEL, protocol.TOPIC_METRIC, self._on_metric)
        monitor = threading.Thread(target=self._monitor, name="server-monitor", daemon=True)
        monitor.start()
        self.report("listening", endpoint=self.cell.endpoint, secure=self.cell.secure)
        context = JobContext(
            self.job_id,
            self.workspace,
            components,
            self.report,
            settings,
            disk_downloads=self.endpoint.downloads_to_disk,
            status_reports=self._status_reports,
            dead_clients=self.liveness.dead,
        )
        try:
            missing = self._wait_clients_ready(CLIENTS_READY_TIMEOUT_S)
            if missing:
                reason = f"clients never connected within {CLIENTS_READY_TIMEOUT_S:.0f} s: {', '.join(missing)}"
                outcome = JobOutcome(JobState.FINISHED_EXECUTION_EXCEPTION, reason)
            else:
                outcome = self._run_workflows(workflows, context)
            outcome = flush_components(components, outcome)
            outcome.warnings = end_of_run_warnings({**components, **workflows})
        finally:
            self.queue.end_run()
            self._tell_task_ready(self.clients)  # they hear END_RUN now, not at their next ask
            self._wait_end_heard()
            self._stopped.set()
            monitor.join(2.0)
            self.chunks_served = self.endpoint.chunks_served
            self.endpoint.close()
            self._metrics.close()  # after the cell: no handler writes a metric any more
        return outcome

    def abort(self, reason: str = "aborted") -> None:
        """Stop the job: the running workflow sees its abort signal."""
        self._abort_reason = reason
        self.abort_signal.set()

    # ----------------------------------------------------------------- workflows

    def _run_workflows(self, workflows: dict[str, Any], context: JobContext) -> JobOutcome:
        try:
            done, running = self.progress.read() if self.resume else ([], None)
        except CheckpointError as e:
            return JobOutcome(JobState.FINISHED_EXECUTION_EXCEPTION, f"cannot resume: {e}", self.rounds)
        for workflow_id, workflow in workflows.items():
            if self.abort_signal.is_set():
                break
            if not isinstance(workflow, Controller):
                return JobOutcome(
                    JobState.FINISHED_EXECUTION_EXCEPTION,
                    f"workflow {workflow_id!r} is a {type(workflow).__name__}, not an engine.controller.Controller",
                    self.rounds,
                )
            if workflow_id in done:  # it completed before the server stopped
                log.info("workflow completed before the restart, not run again id=%s", workflow_id)
                continue
            resuming = workflow_id == running
            if resuming and not workflow.resumable:
                reason = (
                    f"workflow {workflow_id!r} ({type(workflow).__name__}) was running when the server stopped "
                    "and cannot resume; submit the job again to start over"
                )
                return JobOutcome(JobState.FINISHED_ABORTED, reason, self.rounds)
            folder = self.workspace / CHECKPOINT_FOLDER / workflow_id
            own = dataclasses.replace(context, checkpoint_dir=folder, resuming=resuming)
            workflow.bind(self.queue, self.abort_signal, own)
            self.progress.started(workflow_id)
            fault_point("workflow_started")  # the fault suite's hook: a crash once a workflow runs
            log.info("workflow %s id=%s", "resumed" if resuming else "started", workflow_id)
            self.report("workflow_started", workflow=workflow_id, resumed=resuming)
            try:
                workflow.run()
            except Exception as e:
                log.exception("workflow failed id=%s", workflow_id)
                reason = f"workflow {workflow_id!r} failed: {type(e).__name__}: {e}"
                return JobOutcome(JobState.FINISHED_EXECUTION_EXCEPTION, reason, self.rounds)
            finally:
                self.queue.cancel_all()
            if not self.abort_signal.is_set():
                self.progress.completed(workflow_id)
        if self.abort_signal.is_set():
            return JobOutcome(JobState.FINISHED_ABORTED, getattr(self, "_abort_reason", "aborted"), self.rounds)
        return JobOutcome(JobState.FINISHED_COMPLETED, "", self.rounds)

    def _wait_clients_ready(self, timeout_s: float) -> list[str]:
        """Wait until every client has asked for work (so task timeouts do not count start-up time)."""
        deadline = time.monotonic() + timeout_s
        while not self.abort_signal.is_set():
            revoked = self.liveness.revoked()  # it will never connect: the workflows go on without it
            with self._lock:
                missing = [site for site in self.clients if site not in self._seen and site not in revoked]
            if not missing or time.monotonic() > deadline:
                return missing
            self.abort_signal.wait(0.05)
        return []

    def _wait_end_heard(self) -> None:
        deadline = time.monotonic() + END_RUN_GRACE_S
        while time.monotonic() < deadline:
            with self._lock:
                waiting = self._seen - set(self.liveness.dead()) - self._told_end
            if not waiting:
                return
            self._stopped.wait(0.1)
        log.warning("clients did not ask for work after the job ended: %s", sorted(waiting))

    # ----------------------------------------------------------------- handlers

    def _tell_task_ready(self, targets: list[str]) -> None:
        """Tell the connected targets of a new task to ask for it now (saves up to ``retry_s``)."""
        connected = {peer.split(".", 1)[0] for peer in self.cell.peers()}
        for site in self._told_targets(targets, connected) if self.workers else targets:
            if site in connected:
                try:
                    self.cell.send(site, protocol.TASK_CHANNEL, protocol.TOPIC_TASK_READY)
                except CellError as e:  # the client asks again after its retry time anyway
                    log.debug("task-ready notice not sent site=%s: %s", site, e)

    def _clients_only(self, handler: Callable[[Message], Reply]) -> Callable[[Message], Reply]:
        """``handler``, answered for the job's clients only (see `_not_a_client`)."""

        def answer(message: Message) -> Reply:
            refused = self._not_a_client(message)
            return refused if refused is not None else handler(message)

        return answer

    def _not_a_client(self, message: Message) -> Reply | None:
        """Refuse a cell that is not one of the job's clients (e.g. another cell of an allowed site)."""
        if message.source in self.clients and message.header.get(protocol.HEADER_JOB_ID) == self.job_id:
            return None
        log.warning("request refused: %s is not a client of this job topic=%s", message.source, message.topic)
        reason = f"{message.source} is not a client of this job ({self.job_id})"
        return Reply(header={"outcome": "FAILED", "reason": reason}, status=Status.ERROR, reason=reason)

    def _on_get_task(self, message: Message) -> Reply:
        """A client's task request (its cell is one of the job's clients: see `_clients_only`)."""
        site = message.source
        with self._lock:
            joined = site not in self._seen
            self._seen.add(site)
        if joined:
            log.info("client asked for work site=%s", site)
        back = None if self.queue.ended else self.liveness.back(site)
        if back is not None:  # its process was restarted (or it was only away): it takes tasks again
            log.warning("client back site=%s (was dead: %s)", site, back)
            self.report("client_back", site=site, was=back)
        if self.queue.ended:
            with self._lock:
                self._told_end.add(site)
            return Reply(header={"state": protocol.STATE_END})
        assignment = self.queue.next_task(site)
        if assignment is None:
            return Reply(header={"state": protocol.STATE_WAIT, "retry_s": protocol.DEFAULT_RETRY_S})
        try:
            frames = self._task_frames_for(assignment, site)
        except Exception as e:  # a filter or the serializer refused this client's task
            log.warning("task not sent site=%s task=%s: %s", site, assignment.task_name, e)
            self.queue.fail_client_task(site, assignment.task_id, str(e))
            return Reply(header={"state": protocol.STATE_WAIT, "retry_s": protocol.DEFAULT_RETRY_S})
        sent_bytes = payload_bytes(assignment.data)
        with self._lock:  # what a result of this task may stream is measured from it (tasks drop their data)
            self._sent_bytes[assignment.task_id] = (site, sent_bytes)
        self._downloads.sent(assignment.task_id, site, sent_bytes, self._bytes_served())
        self.report(
            "task_sent",
            site=site,
            task=assignment.task_name,
            task_id=assignment.task_id,
            round=assignment.data.get_header(ReservedHeaderKey.CURRENT_ROUND),
        )
        header = {"state": protocol.STATE_TASK, "task_name": assignment.task_name, "task_id": assignment.task_id}
        return Reply(header=header, frames=frames)

    def _task_frames_for(self, assignment: Any, site: str) -> list[Any]:
        """The task's frames: encoded once per task (one downloadable for all its clients), or
        once per client when a data filter may make each client's different, or for a client
        that takes the task again (broadcast for ever): a download is pulled once per receiver."""
        filters = self._data_filters
        task = assignment.client_task.task
        with self._lock:
            again = site in self._delivered.get(id(task), ())
        if again or (filters and not filters.same_for_every_site(assignment.task_name)):
            data = assignment.data
            if filters:
                data = filters.apply(assignment.task_name, _private_copy(data), site)
            offers: list[str] = []
            frames = self.codec.encode(data, receivers=[site], offers=offers)
            with self._lock:
                self._task_offers[assignment.task_id] = (site, offers)
            return frames
        with self._lock:
            for key, (cached, _) in list(self._task_frames.items()):
                if cached.completion_status is not None:
                    del self._task_frames[key]
                    self._offers_of_task.pop(key, None)
                    self._delivered.pop(key, None)
            entry = self._task_frames.get(id(task))
            if entry is None:
                receivers = list(task.targets) if task.targets else list(self.clients)
                offers = []
                data = assignment.data
                if filters:  # filters that ignore the site: once for every client
                    data = filters.apply(assignment.task_name, _private_copy(data), site)
                entry = (task, self.codec.encode(data, receivers=receivers, offers=offers))
                self._task_frames[id(task)] = entry
                self._offers_of_task[id(task)] = offers
            self._task_offers[assignment.task_id] = (site, self._offers_of_task.get(id(task), []))
            self._delivered.setdefault(id(task), set()).add(site)
        return entry[1]

    def _on_status(self, message: Message) -> None:
        """A client's status in a client-controlled workflow (fire and forget: nothing to answer)."""
        site = message.source
        if site not in self.clients:
            REFUSALS.warning(log, "status report refused: %s is not a client of this job", site)
            return None
        try:
            status = WorkflowStatus.from_header(dict(message.header))
        except ValueError as e:
            REFUSALS.warning(log, "status report of %s ignored: %.300s", site, e)
            return None
        if status.workflow not in self._status_workflows:  # kept, it would be an entry per name sent
            REFUSALS.warning(log, "status report of %s ignored: no workflow %.100r in this job", site, status.workflow)
            return None
        with self._lock:
            self._status.setdefault(status.workflow, {})[site] = ReceivedStatus(time.monotonic(), status)
        return None

    def _on_metric(self, message: Message) -> None:
        """A metric a client's script logged (fire and forget); the site is the sender's authenticated name."""
        header = message.header
        same_job = header.get(protocol.HEADER_JOB_ID) == self.job_id
        sender = message.source if same_job else f"{message.source} (of another job)"  # refused as no client
        if self._metrics is not None:
            self._metrics.from_site(sender, header.get("key"), header.get("value"), header.get("round"))
        return None

    def _status_reports(self, workflow: str) -> dict[str, ReceivedStatus]:
        with self._lock:
            return dict(self._status.get(workflow, {}))

    # ----------------------------------------------------------------- monitor

    def _bytes_served(self) -> dict[str, int]:
        service = self.endpoint.service
        return {} if service is None else service.bytes_served()

    def _monitor(self) -> None:
        while not self._stopped.wait(MONITOR_INTERVAL_S):
            try:
                self.queue.check()
                connected = {peer.split(".", 1)[0] for peer in self.cell.peers()}
                connected |= self._stand_ins(connected)  # a virtual client's worker stands for it
                with self._lock:  # a client that heard END_RUN leaves; that is not a death
                    gone = self._seen - set(self.liveness.dead()) - self._told_end - connected
                    sent = list(self._sent_bytes.items())
                    offered = [(task_id, site) for task_id, (site, _) in self._task_offers.items()]
                for task_id, (site, _) in sent:  # tasks that ended without a result
                    if self.queue.expects_result(site, task_id) is not SubmitOutcome.ACCEPTED:
                        with self._lock:
                            self._sent_bytes.pop(task_id, None)
                        self._downloads.ended(task_id)
                for task_id, site in offered:  # nobody will submit under it: its entry would stay to the end
                    if self.queue.expects_result(site, task_id) is not SubmitOutcome.ACCEPTED:
                        with self._lock:
                            self._task_offers.pop(task_id, None)
                for fields in self._downloads.poll(self._bytes_served()):
                    self.report("download_progress", **fields)
                timeout_s = self.site.cell.heartbeat_timeout_s
                for site in sorted(gone):
                    self._mark_dead(site, f"no heartbeat for {timeout_s:g} s", unregister=False)
            except Exception:
                log.exception("server monitor error")


def _one_based_round(fields: dict[str, Any]) -> dict[str, Any]:
    """An event's fields with ``round`` as users count (1, 2, ...): workflows report ``current_round`` (from 0).

    Every round a user reads (the console, events.jsonl, result.json, summary.json) goes through here.
    """
    return {**fields, "round": shown_round(fields["round"])} if "round" in fields else fields


def _private_copy(data: Shareable) -> Shareable:
    """A copy of the task data that one client's filters may change (tensors are shared, not copied)."""
    copy = Shareable(data)
    for key, value in copy.items():
        if isinstance(value, (FLModel, DXO)):
            copy[key] = dataclasses.replace(value)
    return copy
