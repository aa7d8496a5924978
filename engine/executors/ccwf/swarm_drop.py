"""`RoundDrop`: trainers drop a Swarm round its own aggregation client gave up.

A round's aggregation client that could not pull the round's model (its sender was lost as it
was pulled) gives the round up (`GiveUp`); trainers that had the model whole cannot go on with a
round nobody aggregates. The aggregation client asks each of them to drop the round (``swarm_drop``),
so that every client is back at the round before, which the server then has played again. A
trainer drops its round only at the word of that round's aggregation client, once the server
lost the model's sender (`SwarmRoles.drop_refusal`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from engine.cells import Cell, Message, Reply, Status
from engine.cells.protocol import STOP_POLL_S
from engine.executors.ccwf.client_side import refused
from engine.executors.ccwf.swarm_give_up import GiveUp
from engine.executors.ccwf.swarm_roles import SwarmRoles
from engine.model import shown_round
from engine.model.ccwf import CCWF_CHANNEL

log = logging.getLogger(__name__)

#: Header key of a trainer's refusal of a drop: final, the aggregation client asks no more.
DROP_REFUSED_KEY = "drop_refused"


class RoundDrop:
    """Both sides of a dropped round: asking the trainers (at the aggregation client) and taking
    the word (at a trainer).

    Args:
        cell: This client's cell.
        topic: The cell topic of drops (``swarm_drop``).
        roles: The swarm as this client sees it.
        give_up: The round this client gave up, if any.
        stopped: Set when the job ends.
        loss_judged_within_s: How long the server takes to say a dead client is lost.
        ack_timeout_s: Seconds a peer has to answer a Swarm message (``learn_task_ack_timeout``).
        interval_s: Seconds between two tries at a trainer that did not answer.
        spawn: Runs a function on a thread of the controller's (joined when the job ends).
        report_round: Reports the round this client is at (with the phase given).
    """

    def __init__(
        self,
        cell: Cell,
        topic: str,
        roles: SwarmRoles,
        give_up: GiveUp,
        stopped: threading.Event,
        loss_judged_within_s: float,
        ack_timeout_s: float,
        interval_s: float,
        spawn: Callable[[Callable[[], None], str], None],
        report_round: Callable[..., None],
    ) -> None:
        self.cell = cell
        self.topic = topic
        self.roles = roles
        self.give_up = give_up
        self.stopped = stopped
        self.loss_judged_within_s = loss_judged_within_s
        self.ack_timeout_s = ack_timeout_s
        self.interval_s = interval_s
        self.spawn = spawn
        self.report_round = report_round
        self._waiting = threading.Lock()  # held while a drop waits to hear of its sender's loss

    # ----------------------------------------------------------------- at the aggregation client

    def ask(self, trainers: list[str], current_round: int) -> None:
        """Have ``trainers``, which had round ``current_round``'s model this client (its aggregation
        client) gave up, drop the round, in the background: one asker per trainer
        (`GiveUp.to_drop`), asking again every ``interval_s`` while it gets no answer.

        A trainer that refuses (its answer says it is final), or that does not answer for twice the
        time a loss takes to judge plus ``ack_timeout_s`` while the server still has it, ends the
        job (`GiveUp.left_behind`): the swarm cannot go on from there. Asking stops once the round
        before is taken again (the swarm went on) or the job ends.
        """
        for site in self.give_up.to_drop(trainers):
            self.spawn(lambda site=site: self._ask_one(site, current_round), f"drop-{current_round}-{site}")

    def _ask_one(self, site: str, current_round: int) -> None:
        shown = shown_round(current_round)
        # The trainer may hear of the sender's loss a little after this client did, and wait for
        # it (`on_drop`); one that died is lost to the server within about as long.
        deadline = time.monotonic() + 2 * self.loss_judged_within_s + self.ack_timeout_s
        while not self.stopped.is_set():
            if site in self.roles.lost:
                return  # the server plays the round before again without it
            if not self.give_up.gave_up_own_round(current_round):
                return  # the round before was taken again: the swarm went on
            timeout_s = max(1.0, deadline - time.monotonic())
            future = self.cell.request_async(site, CCWF_CHANNEL, self.topic, {"round": current_round}, (), timeout_s)
            reply = None
            while reply is None and not self.stopped.is_set():  # the job's end is not kept waiting
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    reply = future.result(timeout=STOP_POLL_S)
            if reply is None:
                return
            if reply.status is Status.OK:
                log.warning("round %s dropped at %s too: it had the round's model this client gave up", shown, site)
                return
            if reply.header.get(DROP_REFUSED_KEY) is True or time.monotonic() > deadline:
                if not self.stopped.is_set() and site not in self.roles.lost:
                    why = f"{reply.status.value}: {reply.reason}"
                    self.give_up.left_behind(
                        f"{site} had it and handed in a result, and could not drop the round: {why}"
                    )
                return
            self.stopped.wait(self.interval_s)

    # ----------------------------------------------------------------- at a trainer

    def on_drop(self, message: Message) -> Reply:
        """The round's aggregation client gave the round up while this client had its model: drop it
        (`SwarmRoles.drop_refusal`) and report the round before, which the server has played again.

        Checks that can never pass are answered at once; only the wait for the server's word on
        the model's sender holds a handler thread, one at most (a drop arriving meanwhile is asked
        to come again). A refusal says whether it is final (`DROP_REFUSED_KEY`): asking again
        would change nothing.
        """
        current_round = message.header.get("round")
        if type(current_round) is not int:
            return refused(message, f"the message names no round number (round={current_round!r})")
        why = self.roles.drop_blocked(message.source, current_round)
        sender = self.roles.sender_of(current_round)
        if why is None and sender is not None and sender not in self.roles.lost:
            # This client may be told of the sender's loss a little after its aggregation client was.
            if not self._waiting.acquire(blocking=False):
                return refused(message, "another drop waits for the server's word on its sender; ask again")
            try:
                self.give_up.lost_soon(sender, self.loss_judged_within_s)
            finally:
                self._waiting.release()
        why = why or self.roles.drop_refusal(message.source, current_round)
        if why:
            reply = refused(message, why)
            return dataclasses.replace(reply, header={**reply.header, DROP_REFUSED_KEY: True})
        if sender is not None:  # None: dropped already, at the same word (the answer was lost)
            log.warning(
                "round %s dropped: its aggregation client %s never got its model whole (its sender %s was lost)",
                shown_round(current_round),
                message.source,
                sender,
            )
        self.report_round(phase="idle")
        return Reply(header={})
