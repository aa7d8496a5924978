"""`SwarmServerController`: the server's part of Swarm learning (it never holds a model)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from engine.controller import Task
from engine.errors import WorkflowError
from engine.model import Shareable, shown_round
from engine.model.ccwf import (
    LOST_KEY,
    LOST_TASK,
    REPLAY_EXCLUDE_KEY,
    REPLAY_ROUND_KEY,
    REPLAY_TASK,
    STARTS_AGAIN_KEY,
    WorkflowStatus,
)
from engine.workflows.ccwf.server_side import ServerSideController, clients_among, failed_clients

log = logging.getLogger(__name__)

#: Task name prefix of Swarm learning; clients route ``swarm_*`` to their `SwarmClientController`.
SWARM_PREFIX = "swarm"
#: Rounds a swarm may play again in all (each after losing a round's aggregation client).
MAX_ROUND_REPLAYS = 3


class SwarmServerController(ServerSideController):
    """Swarm learning: the clients train, and each round one of them aggregates and starts the next.

    The server configures the clients, tells the starting client to begin, and follows their
    status reports (see `ServerSideController`). Models move between the clients only.

    Args:
        num_rounds: Rounds of training.
        start_round: The first round's number.
        start_task_timeout: Seconds the starting client has to load the model and send round one.
        configure_task_timeout: Seconds every client has to take the config task.
        participating_clients: The clients that take part; None = all.
        result_clients: The clients that receive the final model; None = all participants.
        starting_client: The client that loads the initial model; empty = the first participant.
        max_status_report_interval: Seconds a client may stay silent before it counts as lost.
        progress_timeout: Seconds the swarm may go without any client making progress.
        aggr_clients: The clients that may aggregate a round; None = all participants.
        train_clients: The clients that train; None = all participants.
        min_clients: The fewest clients the swarm goes on with when others are lost; 0 = all.
        task_name_prefix: Prefix of the task names (``swarm``).
    """

    def __init__(
        self,
        num_rounds: int,
        start_round: int = 0,
        start_task_timeout: float = 10.0,
        configure_task_timeout: float = 300.0,
        participating_clients: list[str] | None = None,
        result_clients: list[str] | None = None,
        starting_client: str = "",
        max_status_report_interval: float = 90.0,
        progress_timeout: float = 3600.0,
        aggr_clients: list[str] | None = None,
        train_clients: list[str] | None = None,
        min_clients: int = 0,
        task_name_prefix: str = SWARM_PREFIX,
    ) -> None:
        super().__init__(
            task_name_prefix,
            num_rounds=num_rounds,
            start_round=start_round,
            configure_task_timeout=configure_task_timeout,
            start_task_timeout=start_task_timeout,
            participating_clients=participating_clients,
            starting_client=starting_client,
            max_status_report_interval=max_status_report_interval,
            progress_timeout=progress_timeout,
            min_clients=min_clients,
        )
        self._replays = 0
        # round played again -> (the client told to send its model, the aggregation client it replaces)
        self._replaying: dict[int, tuple[str, str]] = {}
        self.result_clients = list(result_clients) if result_clients is not None else None
        self.aggr_clients = list(aggr_clients) if aggr_clients else None
        self.train_clients = list(train_clients) if train_clients else None

    def workflow_config(self, participants: list[str]) -> dict[str, Any]:
        config = super().workflow_config(participants)
        config.update(
            aggr_clients=clients_among("aggr_clients", self.aggr_clients, participants),
            train_clients=clients_among("train_clients", self.train_clients, participants),
            result_clients=clients_among("result_clients", self.result_clients, participants),
        )
        if not config["aggr_clients"] or not config["train_clients"]:
            raise WorkflowError("aggr_clients and train_clients must each name at least one participating client")
        return config

    def starter_loss_is_judged(self) -> bool:
        """Yes: another aggregation client can send the first round's model (`recover_from_loss`)."""
        return True

    def finishers(self, participants: list[str]) -> list[str]:
        """Only an aggregation client finishes a round, and the last round's ends the swarm."""
        return clients_among("aggr_clients", self.aggr_clients, participants)

    def loss_ends_workflow(
        self,
        site: str,
        reports: Mapping[str, WorkflowStatus],
        latest_round: int,
        rounds_done: set[int],
        participants: list[str],
        gone: set[str],
    ) -> str | None:
        """A round's aggregation client holds the round: lost before the swarm moved past it, it cannot go on.
        So does the starting client (or the client that sends the first round's model again) while
        no other client reports having that model (none took it, or all gave it up).

        Which client aggregates the round is what the other clients' reports of it say (the
        round's model names it; it is not always the one whose turn it was: one that did not
        answer is skipped), all of them that report the round, and it must be an aggregation client.
        Lost before the round is done, it held the round's results; lost after it reported the
        round done, while no client reports a later round, it held the next round's model (or the
        final model, not yet with every result client) and nobody else has it.
        """
        if latest_round < self.start_round:  # no other client has the first round's model
            first = shown_round(self.start_round)
            if site == self.starter:
                return f"it started the swarm, and no other client has round {first}'s model"
            if site == self._replaying.get(self.start_round, ("", ""))[0]:
                return f"it was sending round {first}'s model again, and no other client has it"
            return None
        shown = shown_round(latest_round)
        sender, replaced = self._replaying.get(latest_round, ("", ""))
        if sender == site:
            missed = sorted(
                other
                for other, status in reports.items()
                if other != site and other not in gone and status.round == latest_round and status.aggr == replaced
            )
            if missed:
                return f"it was sending round {shown}'s model again, which {', '.join(missed)} did not take yet"
        if site not in clients_among("aggr_clients", self.aggr_clients, participants):
            return None
        named = {
            other: status.aggr for other, status in reports.items() if other != site and status.round == latest_round
        }
        named_by = sorted(other for other, aggr in named.items() if aggr == site)
        if not named_by or len(named_by) != len(named):  # none, or they do not agree
            return None
        by = ", ".join(named_by)
        if latest_round not in rounds_done:
            return f"it aggregates round {shown} (as {by} reported), which no other client can finish"
        own = reports.get(site)
        if own is None or not any(done.get("round") == latest_round for done in own.rounds_done):
            return None  # another client finished the round
        if not self._is_last(latest_round):
            return f"it aggregated round {shown} (as {by} reported) and was the only client with its next round"
        holders, missing = self._final_holders(reports, site, [other for other in participants if other not in gone])
        if not holders and not missing:
            return f"it aggregated the last round (as {by} reported), and no result client is left"
        if not missing:
            return None  # every result client left has the final model: the swarm is done
        if holders:
            return (
                f"it aggregated the last round (as {by} reported) and was sending the final model, "
                f"which {', '.join(holders)} saved but not {', '.join(missing)}"
            )
        return f"it aggregated the last round (as {by} reported) and was the only client with the final model"

    def finished_without(
        self,
        reports: Mapping[str, WorkflowStatus],
        rounds_done: set[int],
        gone: set[str],
        participants: list[str],
    ) -> str | None:
        """The last round is done and every result client left saved the final model (its sender is lost)."""
        if not self._is_last(max(rounds_done, default=-1)):
            return None
        holders, missing = self._final_holders(reports, "", [site for site in participants if site not in gone])
        if missing or not holders:
            return None
        return f"the final model is with every result client left ({', '.join(holders)})"

    def _is_last(self, number: int) -> bool:
        return number == self.start_round + self.num_rounds - 1

    def _final_holders(
        self, reports: Mapping[str, WorkflowStatus], lost: str, candidates: list[str]
    ) -> tuple[list[str], list[str]]:
        """The result clients of ``candidates`` (but ``lost``) whose report says they saved the final
        model, and the others."""
        result_clients = [
            site for site in candidates if site != lost and (self.result_clients is None or site in self.result_clients)
        ]
        holders = [site for site in result_clients if site in reports and reports[site].phase == "done"]
        return holders, [site for site in result_clients if site not in holders]

    def recover_from_loss(
        self, site: str, reports: Mapping[str, WorkflowStatus], latest_round: int, lost: set[str]
    ) -> str:
        """Play the round again: the client that sent its model sends it to another aggregation client.

        That client is the one that aggregated the round before (its last saved model is the
        round's model) or, for the first round, the starting client, which reads its starting
        checkpoint again. Lost itself, the first aggregation client left does so in its place,
        once the others were told of the loss and of it (they take the round's model from it
        only then).

        Raises:
            WorkflowError: `MAX_ROUND_REPLAYS` rounds were played again already, that client is
                lost too, or it could not (its task failed): why.
        """
        if self._replays >= MAX_ROUND_REPLAYS:
            raise WorkflowError(f"{self._replays} rounds were played again already (at most {MAX_ROUND_REPLAYS})")
        latest_round = max(latest_round, self.start_round)  # no client reports the first round yet
        if self._is_last(latest_round):
            holders, missing = self._final_holders(reports, site, [other for other in reports if other not in lost])
            if holders:
                # A result client that saved it would not take another (and its persistor's last saved
                # model is no longer the round's): a final model made again would differ from site to site.
                raise WorkflowError("a final model that some result clients saved cannot be made again")
            if not missing:
                raise WorkflowError("the final model would go to nobody")
        trusted = self.aggr_clients if self.aggr_clients is not None else list(reports)
        if latest_round == self.start_round:
            sender = self._starting_sender(trusted, reports, lost)
        else:
            sender = _aggregator_of(reports, latest_round - 1, trusted)
        if not sender or sender in lost:
            raise WorkflowError(f"no client left holds round {shown_round(latest_round)}'s model to play it again")
        data = Shareable({REPLAY_ROUND_KEY: latest_round, REPLAY_EXCLUDE_KEY: sorted(lost)})
        task = Task(self.task_name(REPLAY_TASK), data, timeout=self.start_task_timeout)
        self.send_and_wait(task, [sender], abort_signal=self.abort_signal)
        failures = failed_clients(task, [sender])
        if failures:
            raise WorkflowError(f"{sender} could not play round {shown_round(latest_round)} again: {failures[sender]}")
        self._replays += 1
        self._replaying[latest_round] = (sender, site)
        return f"{sender} sent round {shown_round(latest_round)}'s model again, to another aggregation client"

    def _starting_sender(self, aggrs: list[str], reports: Mapping[str, WorkflowStatus], lost: set[str]) -> str:
        """Who sends the first round's model again: the starting client, else (lost) the first
        aggregation client left, once the clients left were told ("" when none is left).

        A client takes the first round's model from another than the starting client only from
        the one the server names, and only once told that the server lost the starting client
        (`SwarmRoles.starts_again_from`): the clients left (dead ones are not waited for) are
        told first, each given `max_status_report_interval` seconds to answer.
        """
        if self.starter not in lost:
            return self.starter
        dead = self.context.dead()
        left = [site for site in reports if site not in lost and site not in dead]
        sender = next((site for site in aggrs if site in left), "")
        if sender:
            task = self._lost_task(sorted(lost), starts_again=sender)
            self.broadcast_and_wait(task, left, min_responses=0, abort_signal=self.abort_signal)
            unaware = failed_clients(task, left)
            if unaware:
                log.warning("not told who sends round %s's model again: %s", shown_round(self.start_round), unaware)
        return sender

    def clients_lost(self, lost: list[str], participants: list[str]) -> None:
        """Tell ``participants`` (but the lost) whom the swarm lost (a ``swarm_lost`` task each, answered at once).

        The next rounds' models skip them, an aggregation client stops waiting for their results
        (its round closes once the others answered), and nothing they send is taken. Not waited
        for; it stays open for ``max_status_report_interval`` seconds (a client away longer is
        lost itself, and one back from a loss before it is judged is told again).
        """
        left = [site for site in participants if site not in lost]
        if not left:
            return
        self.broadcast(self._lost_task(lost), left, min_responses=0)
        log.info("clients told whom the swarm lost: %s", ", ".join(lost))

    def _lost_task(self, lost: list[str], starts_again: str = "") -> Task:
        """A ``swarm_lost`` task naming ``lost`` (and who sends the first round's model again, if
        ``starts_again``), open for ``max_status_report_interval`` seconds."""
        data = Shareable({LOST_KEY: lost, **({STARTS_AGAIN_KEY: starts_again} if starts_again else {})})
        return Task(self.task_name(LOST_TASK), data, timeout=self.max_status_report_interval)

    def run(self) -> None:
        self.context.report("workflow_note", message=f"swarm: {self.num_rounds} rounds, the clients aggregate")
        super().run()


def _aggregator_of(reports: Mapping[str, WorkflowStatus], number: int, trusted: list[str]) -> str:
    """The aggregation client (of ``trusted``) that reported round ``number`` done ("" when none did)."""
    for site, status in reports.items():
        if site in trusted and any(done.get("round") == number for done in status.rounds_done):
            return site
    return ""
