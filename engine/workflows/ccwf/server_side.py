"""`ServerSideController`: the server's part of a client-controlled workflow.

The server holds no model here. It sends ``<prefix>_config`` to every participating client (this
also checks that each is ready), ``<prefix>_start`` to the starting client, and then follows the
status reports the clients send on their own: the job ends when one reports that the workflow is
done, when one reports an error, when too few clients are left, or when no client made progress
for ``progress_timeout`` seconds. A report is a claim: only a participant's counts, and only a
client the workflow gave that role (`ServerSideController.finishers`) can end the workflow or
finish a round, and only a round of the workflow.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from engine.controller import Controller, Task, TaskCompletionStatus
from engine.controller.context import ReceivedStatus
from engine.errors import WorkflowError
from engine.model import ReturnCode, Shareable, shown_round
from engine.model.ccwf import CONFIG_KEY, CONFIG_TASK, START_TASK, WorkflowStatus

log = logging.getLogger(__name__)

#: Seconds between two looks at the clients' status reports.
STATUS_CHECK_INTERVAL_S = 0.5
#: Header of a failed client result that says why (as the executors set it).
REASON_HEADER = "reason"


@dataclasses.dataclass
class _Following:
    """What the server learnt of the clients while it follows a workflow (`ServerSideController._follow`)."""

    started: float
    last_progress: float = dataclasses.field(init=False)  # when a client's report last showed progress
    progress_seen: dict[str, int] = dataclasses.field(default_factory=dict)
    rounds_seen: set[int] = dataclasses.field(default_factory=set)
    latest_round: int = -1
    lost: set[str] = dataclasses.field(default_factory=set)
    #: lost sites not yet judged -> (when, why)
    unjudged: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    untrusted_done: set[str] = dataclasses.field(default_factory=set)
    #: lost sites judged: lost for good, what they report is ignored
    gone: set[str] = dataclasses.field(default_factory=set)
    #: rounds a recovery plays again: their next "done" is reported anew
    played_again: set[int] = dataclasses.field(default_factory=set)
    #: gone, their loss not fatal yet -> (why, last report, latest round when judged)
    harmless: dict[str, tuple[str, WorkflowStatus | None, int]] = dataclasses.field(default_factory=dict)
    #: lost sites judged lost even if they report again (the starting client that died starting)
    never_back: set[str] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.last_progress = self.started


class ServerSideController(Controller):
    """Configures, starts and follows a workflow that the clients run among themselves.

    Args:
        task_name_prefix: Prefix of the workflow's task names (``<prefix>_config`` ...); the
            clients route ``<prefix>_*`` to their client-side controller.
        num_rounds: Rounds the clients run.
        start_round: The first round's number.
        configure_task_timeout: Seconds every client has to take and answer the config task.
        start_task_timeout: Seconds the starting client has to start the workflow.
        participating_clients: The clients that take part; None = all of the job's clients.
        starting_client: The client that starts the workflow; empty = the first participant.
        max_status_report_interval: Seconds a client may stay silent before it counts as lost.
        progress_timeout: Seconds the workflow may go without any client making progress.
        min_clients: The fewest participating clients the workflow may go on with when others
            are lost (dead, or silent past ``max_status_report_interval``); 0 = all of them.
    """

    needs_live_clients = True

    def __init__(
        self,
        task_name_prefix: str,
        num_rounds: int = 1,
        start_round: int = 0,
        configure_task_timeout: float = 300.0,
        start_task_timeout: float = 10.0,
        participating_clients: list[str] | None = None,
        starting_client: str = "",
        max_status_report_interval: float = 90.0,
        progress_timeout: float = 3600.0,
        min_clients: int = 0,
    ) -> None:
        super().__init__()
        _positive("num_rounds", num_rounds)
        for name, value in (
            ("configure_task_timeout", configure_task_timeout),
            ("start_task_timeout", start_task_timeout),
            ("max_status_report_interval", max_status_report_interval),
            ("progress_timeout", progress_timeout),
        ):
            _positive(name, value)
        if start_round < 0 or min_clients < 0:
            raise ValueError(f"start_round and min_clients must be >= 0, got {start_round} and {min_clients}")
        self.task_name_prefix = task_name_prefix
        self.status_workflow = task_name_prefix
        self.num_rounds = num_rounds
        self.start_round = start_round
        self.configure_task_timeout = configure_task_timeout
        self.start_task_timeout = start_task_timeout
        self.participating_clients = list(participating_clients) if participating_clients else None
        self.starting_client = starting_client
        self.max_status_report_interval = max_status_report_interval
        self.progress_timeout = progress_timeout
        self.min_clients = min_clients
        #: The client the start task went to (set by `run`).
        self.starter = ""
        #: (the starting client, why) when it died before it answered its start task (`starter_loss_is_judged`)
        self._died_starting: tuple[str, str] | None = None

    # ----------------------------------------------------------------- for subclasses

    @property
    def status_interval_s(self) -> float:
        """Seconds between two status reports of a client (what the config task tells them)."""
        return min(5.0, self.max_status_report_interval / 3)

    def workflow_config(self, participants: list[str]) -> dict[str, Any]:
        """What the config task tells every client (subclasses add their own keys)."""
        return {
            "num_rounds": self.num_rounds,
            "start_round": self.start_round,
            "participants": participants,
            "status_interval": self.status_interval_s,
        }

    def configured(self, replies: dict[str, Shareable]) -> None:  # noqa: B027 - optional hook
        """Called with every client's answer to the config task once all answered OK."""

    def starts(self) -> bool:
        """Whether a start task goes to a starting client (a workflow driven by the server says no)."""
        return True

    def starter_loss_is_judged(self) -> bool:
        """Whether a starting client that died before it answered its start task (the runtime
        found it dead: the task ended ``CLIENT_DEAD``) is followed as a lost client, its loss
        judged like any other (see `loss_ends_workflow`) and never taken back, instead of ending
        the workflow at once (the default)."""
        return False

    def finishers(self, participants: list[str]) -> list[str]:
        """The clients whose reports that a round or the workflow is done are believed (all participants)."""
        return participants

    def loss_ends_workflow(
        self,
        site: str,
        reports: Mapping[str, WorkflowStatus],
        latest_round: int,
        rounds_done: set[int],
        participants: list[str],
        gone: set[str],
    ) -> str | None:
        """Why losing ``site`` ends the workflow unless `recover_from_loss` can; None (the default): it goes on.

        Asked once the other clients had time to report past it (see `_judge_lost`), and only if it
        has not come back: it is lost for good, and what it reports is ignored from then on.
        ``reports``: the latest report of every participant not lost for good before this pass
        (``site``'s too); ``latest_round``: the latest round any other client reported, or an
        aggregation client reported done (what ``site`` alone claims is not counted);
        ``rounds_done``: the rounds an aggregation client reported done; ``gone``: every
        client lost for good, ``site`` too.
        """
        return None

    def finished_without(
        self,
        reports: Mapping[str, WorkflowStatus],
        rounds_done: set[int],
        gone: set[str],
        participants: list[str],
    ) -> str | None:
        """Why the workflow is done though no finisher reported it (the one that would have is lost:
        ``gone``, the clients lost for good); None (the default): it is not.

        ``reports``: the latest report of every participant not lost for good.
        """
        return None

    def recover_from_loss(
        self, site: str, reports: Mapping[str, WorkflowStatus], latest_round: int, lost: set[str]
    ) -> str:
        """Make the workflow go on without ``site``, whose loss `loss_ends_workflow` judged fatal.

        ``lost``: every client lost for good, ``site`` too.

        Returns:
            What was done, for the workflow's note.

        Raises:
            WorkflowError: Nothing could be done (the default): why; the workflow ends with it.
        """
        raise WorkflowError(f"{type(self).__name__} cannot go on without it")

    def clients_lost(self, lost: list[str], participants: list[str]) -> None:  # noqa: B027 - optional hook
        """Called once clients are judged lost for good (`_judge_lost`): ``lost``, every one so far, sorted.

        A lost client is not taken back should it return (it still counts as lost for
        ``min_clients``). Nothing to do by default; Swarm tells the clients left.
        """

    def follow_clients(self, participants: list[str]) -> None:
        """After the start: follow the status reports until the workflow is done (see the module)."""
        self._follow(participants)

    # ----------------------------------------------------------------- the workflow

    def run(self) -> None:
        participants = self.participants()
        starter = ""
        if self.starts():
            starter = self.starting_client or participants[0]
            self.starter = starter
            if starter not in participants:
                raise WorkflowError(f"starting_client {starter!r} is not a participating client ({participants})")
        config = self.workflow_config(participants)
        config["starting_client"] = starter
        replies = self._configure(participants, config)
        if replies is None:
            return
        self.configured(replies)
        if starter and not self._start(starter):
            return
        self.follow_clients(participants)

    def participants(self) -> list[str]:
        """The participating clients, checked against the job's clients."""
        known = self.get_clients()
        chosen = self.participating_clients or known
        unknown = [site for site in chosen if site not in known]
        if unknown:
            raise WorkflowError(
                f"participating_clients: {', '.join(unknown)} not among the job's clients ({', '.join(known)})"
            )
        return list(chosen)

    def task_name(self, suffix: str) -> str:
        return f"{self.task_name_prefix}_{suffix}"

    def _configure(self, participants: list[str], config: dict[str, Any]) -> dict[str, Shareable] | None:
        data = Shareable({CONFIG_KEY: config})
        task = Task(self.task_name(CONFIG_TASK), data, timeout=self.configure_task_timeout)
        self.broadcast_and_wait(task, participants, min_responses=len(participants), abort_signal=self.abort_signal)
        if self.abort_signal.is_set():
            return None
        failures = failed_clients(task, participants)
        if failures:
            raise WorkflowError(
                f"{task.name} failed (configure_task_timeout={self.configure_task_timeout:g} s): "
                + "; ".join(f"{site}: {why}" for site, why in failures.items())
            )
        return {site: task.last_client_task_map[site].result or Shareable() for site in participants}

    def _start(self, starter: str) -> bool:
        task = Task(self.task_name(START_TASK), Shareable(), timeout=self.start_task_timeout)
        self.send_and_wait(task, [starter], abort_signal=self.abort_signal)
        if self.abort_signal.is_set():
            return False
        failures = failed_clients(task, [starter])
        client_task = task.last_client_task_map.get(starter)
        died = (
            starter in self.context.dead()
            if client_task is None  # it died before it took the task
            else client_task.status is TaskCompletionStatus.CLIENT_DEAD
        )
        if failures and died and self.starter_loss_is_judged():
            why = f"died starting the workflow ({self.context.dead_reasons().get(starter, 'dead')})"
            self._died_starting = (starter, why)
            self.context.report("workflow_note", message=f"{starter} {why}; its loss is judged like any other")
            log.warning("starting client died site=%s: %s", starter, failures[starter])
            return True
        if failures:
            raise WorkflowError(
                f"{task.name} failed on {starter} "
                f"(start_task_timeout={self.start_task_timeout:g} s): {failures[starter]}"
            )
        log.info("workflow started by %s prefix=%s", starter, self.task_name_prefix)
        return True

    def _follow(self, participants: list[str]) -> None:
        """Look at the clients' status reports every `STATUS_CHECK_INTERVAL_S` until the workflow is
        done (see the module) or the job aborts; raise `WorkflowError` with the reason when it
        cannot go on."""
        state = _Following(started=time.monotonic())
        if self._died_starting is not None:  # judged after the same wait as any loss, never back
            starter, why = self._died_starting
            state.lost.add(starter)
            state.unjudged[starter] = (state.started, why)
            state.never_back.add(starter)
        while not self.abort_signal.wait(STATUS_CHECK_INTERVAL_S):
            now = time.monotonic()
            reports = self.context.client_status(self.task_name_prefix)
            reports = {site: entry for site, entry in reports.items() if site not in state.gone}
            statuses = {site: reports[site].status for site in participants if site in reports}
            for site, status in statuses.items():
                if status.error:
                    raise WorkflowError(f"{site} reported an error: {status.error}")
            trusted = set(self.finishers(participants))
            self._report_rounds(state, statuses, trusted)
            for site, status in statuses.items():
                if status.progress != state.progress_seen.get(site):
                    state.progress_seen[site] = status.progress
                    state.last_progress = now
            if self._done(state, statuses, trusted, participants):
                return
            dead = self.context.dead()
            self._note_lost(state, participants, reports, dead, now)
            self._judge_lost(state, participants, statuses, reports, dead, now)
            self._check_going_on(state, participants, reports, now)

    def _report_rounds(self, state: _Following, statuses: Mapping[str, WorkflowStatus], trusted: set[str]) -> None:
        """Report each round a trusted client finished (once, in order; again when played again),
        and each round a client began that was not reported yet."""
        first, end = self.start_round, self.start_round + self.num_rounds
        finished = sorted(
            (
                done
                for site, status in statuses.items()
                if site in trusted
                for done in status.rounds_done
                if isinstance(done.get("round"), int) and first <= done["round"] < end
            ),
            key=lambda done: done["round"],
        )
        for done in finished:
            if done["round"] not in state.rounds_seen:
                if done["round"] > state.latest_round:  # its start was not seen yet: say it first, in order
                    state.latest_round = done["round"]
                    self.context.report("round_started", round=state.latest_round, total_rounds=end, clients=[])
                state.rounds_seen.add(done["round"])
                again = {"played_again": True} if done["round"] in state.played_again else {}
                state.played_again.discard(done["round"])
                self.context.report("round_done", **done, **again)
        rounds = [
            status.round
            for status in statuses.values()
            if isinstance(status.round, int) and first <= status.round < end
        ]
        if rounds and max(rounds) > state.latest_round:
            state.latest_round = max(rounds)
            self.context.report("round_started", round=state.latest_round, total_rounds=end, clients=[])

    def _done(
        self, state: _Following, statuses: Mapping[str, WorkflowStatus], trusted: set[str], participants: list[str]
    ) -> bool:
        """Whether the workflow is done: a client it trusts to say so said it, or, once clients
        were lost, `finished_without` says it is."""
        done_by = [site for site, status in statuses.items() if status.all_done and site in trusted]
        for site in sorted(site for site, status in statuses.items() if status.all_done and site not in trusted):
            if site not in state.untrusted_done:
                state.untrusted_done.add(site)
                log.warning("'workflow done' report of %s ignored: it has no role that ends the workflow", site)
        if done_by:
            log.info("workflow done, reported by %s prefix=%s", done_by[0], self.task_name_prefix)
            return True
        finished = self.finished_without(statuses, state.rounds_seen, state.gone, participants) if state.gone else None
        if finished:
            self.context.report("workflow_note", message=f"{self.task_name_prefix} done: {finished}")
            log.info("workflow done without its finisher prefix=%s: %s", self.task_name_prefix, finished)
            return True
        return False

    def _note_lost(
        self,
        state: _Following,
        participants: list[str],
        reports: Mapping[str, ReceivedStatus],
        dead: set[str],
        now: float,
    ) -> None:
        """Note the clients lost now: dead, or silent past ``max_status_report_interval``; their
        loss is judged later (`_judge_lost`)."""
        for site in participants:
            if site in state.lost:
                continue
            entry = reports.get(site)
            silent_s = now - (entry.received if entry else state.started)
            if site in dead or silent_s > self.max_status_report_interval:
                state.lost.add(site)
                why = "stopped answering" if site in dead else f"sent no status for {silent_s:.0f} s"
                state.unjudged[site] = (now, why)
                self.context.report("workflow_note", message=f"{site} {why}; going on without it")
                log.warning("client lost site=%s: %s", site, why)

    def _judge_lost(
        self,
        state: _Following,
        participants: list[str],
        statuses: Mapping[str, WorkflowStatus],
        reports: Mapping[str, ReceivedStatus],
        dead: set[str],
        now: float,
    ) -> None:
        """Judge what the clients lost two status intervals ago held (what a lost site held shows
        in the others' reports by then: a round it finished, or one that moved on without it),
        unless they are back; then judge the loss of each again at every look while it costs
        nothing yet (for two rounds): a round's model pulled from one of them when it died is
        given up by its receivers, who report the round before again (see `loss_ends_workflow`).

        Raises:
            WorkflowError: A loss ends the workflow (`_judge_loss`).
        """
        judged: dict[str, str] = {}  # lost for good from now on -> why it was lost
        for site, (since, why) in list(state.unjudged.items()):
            if now - since < 2 * self.status_interval_s:
                continue
            del state.unjudged[site]
            entry = reports.get(site)
            if site not in dead and entry is not None and entry.received > since and site not in state.never_back:
                state.lost.discard(site)  # it is back
                if state.gone:  # whom the others were told of while it was away
                    self.clients_lost(sorted(state.gone), [site])
                continue
            judged[site] = why
        if judged:
            state.gone.update(judged)
            self.clients_lost(sorted(state.gone), participants)  # first: the clients left stop taking from them
            state.harmless.update({site: (why, statuses.get(site), state.latest_round) for site, why in judged.items()})
        for site, (why, last, judged_at) in list(state.harmless.items()):
            if state.latest_round > judged_at + 1:  # two rounds on: what it held is long past
                del state.harmless[site]
                continue
            with_it = statuses if last is None else {**statuses, site: last}
            again = self._judge_loss(site, why, with_it, state.rounds_seen, participants, state.gone)
            if again is not None:
                del state.harmless[site]
                state.rounds_seen.discard(again)  # a round it had finished is played again too
                state.played_again.add(again)

    def _check_going_on(
        self, state: _Following, participants: list[str], reports: Mapping[str, ReceivedStatus], now: float
    ) -> None:
        """Raise `WorkflowError` when fewer than ``min_clients`` are left, or no client made
        progress for ``progress_timeout`` seconds."""
        needed = self.min_clients or len(participants)
        if len(participants) - len(state.lost) < needed:
            raise WorkflowError(
                f"too few clients left: {', '.join(sorted(state.lost))} lost (dead, or no status within "
                f"max_status_report_interval={self.max_status_report_interval:g} s); "
                f"{len(participants) - len(state.lost)} of {len(participants)} left, min_clients={needed}"
            )
        if now - state.last_progress > self.progress_timeout:
            where = ", ".join(
                f"{site}: round {shown_round(entry.status.round)} {entry.status.phase}"
                for site, entry in sorted(reports.items())
            )
            raise WorkflowError(
                f"no progress for {now - state.last_progress:.0f} s (progress_timeout={self.progress_timeout:g} s); "
                f"last reports: {where or 'none'}"
            )

    def _judge_loss(
        self,
        site: str,
        why: str,
        reports: Mapping[str, WorkflowStatus],
        rounds_done: set[int],
        participants: list[str],
        gone: set[str],
    ) -> int | None:
        """Judge the loss of ``site`` (lost for good: ``why``); the round played again after it, or
        None when its loss costs nothing (yet).

        Raises:
            WorkflowError: Its loss ends the workflow: why, and why nothing could be done.
        """
        first, end = self.start_round, self.start_round + self.num_rounds
        held = _latest_round_without(site, reports, rounds_done, first, end)
        reason = self.loss_ends_workflow(site, reports, held, rounds_done, participants, gone)
        if not reason:
            return None
        try:
            done = self.recover_from_loss(site, reports, held, gone)
        except WorkflowError as e:
            raise WorkflowError(f"{site} is lost ({why}), and {reason}; {e}") from e
        self.context.report("workflow_note", message=f"{site} {why} and {reason}: {done}")
        log.warning("workflow recovered from a loss site=%s: %s", site, done)
        return max(held, first)  # no client reported the first round yet: that one is played again


def _latest_round_without(
    site: str, statuses: Mapping[str, WorkflowStatus], rounds_done: set[int], first: int, end: int
) -> int:
    """The latest round of the workflow that a client other than ``site`` reported working on, or
    that an aggregation client reported done (-1 when none): a lost site's own claims do not move
    the round its loss is judged by."""
    rounds = [
        status.round
        for other, status in statuses.items()
        if other != site and isinstance(status.round, int) and first <= status.round < end
    ]
    return max([*rounds, *rounds_done], default=-1)


def clients_among(name: str, chosen: list[str] | None, participants: list[str]) -> list[str]:
    """The clients an arg names (all participants when None), each checked to be a participant."""
    if chosen is None:
        return list(participants)
    outside = [site for site in chosen if site not in participants]
    if outside:
        raise WorkflowError(f"{name}: {', '.join(outside)} not among the participating clients ({participants})")
    return list(chosen)


def failed_clients(task: Task, targets: list[str]) -> dict[str, str]:
    """Why each target of a finished task did not return an OK result (empty when all did)."""
    failures = {}
    for site in targets:
        client_task = task.last_client_task_map.get(site)
        if client_task is None:
            failures[site] = "never took the task"
            continue
        result = client_task.result
        code = result.get_return_code() if result is not None else None
        if client_task.status is TaskCompletionStatus.OK and code is ReturnCode.OK:
            continue
        reason = (result.get_header(REASON_HEADER) if result is not None else None) or client_task.reason
        status = client_task.status.value if client_task.status else "no result"
        failures[site] = f"{status}: {reason}" if reason else status
    return failures


def _positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")
