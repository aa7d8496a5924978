"""`GiveUp`: a Swarm client's round whose model's sender was lost as it was pulled.

The client gives the round up as if its model never came (`SwarmRoles.untake`): back at the round
before, it waits for the server to have that one played again, or, when another client had the
model whole and the swarm went on with the round, takes the next round's model from the round's
aggregation client (`SwarmRoles.learn_refusal`) and misses one round. At the round's own
aggregation client, a trainer's result of the round shows a trainer had the model: that trainer
drops the round too (`SwarmRoles.drop_refusal`), so that the round before is played again. What
it cannot follow ends the job (`left_behind`): the swarm going past the next round too, or a
trainer that had the round and cannot drop it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from engine.executors.ccwf.client_side import owner_among
from engine.executors.ccwf.swarm_roles import REPLAY_KEY, SwarmRoles
from engine.model import shown_round


class GiveUp:
    """The pull of a round's model in progress, and the round this client gave up, if any.

    Thread-safe: the learner gives rounds up and takes them, the cell's handlers look for what
    shows the swarm went on.

    Args:
        site: This client's name.
        roles: The swarm's roles as this client sees them.
        stopped: Set when the job ends.
        report_error: Ends the job with a reason (the client's status report).
    """

    def __init__(
        self, site: str, roles: SwarmRoles, stopped: threading.Event, report_error: Callable[[str], None]
    ) -> None:
        self.site = site
        self.roles = roles
        self.stopped = stopped
        self.report_error = report_error
        self._lock = threading.Lock()  # guards given_up where it is changed
        #: The sender of the round's model pulled now, and what stops that pull (set when the server
        #: loses the sender, or the job ends).
        self._pulling: tuple[str, threading.Event] | None = None
        #: The round given up and its aggregation client, while this client waits for the round
        #: before to be played again or the swarm to go on without it.
        self.given_up: tuple[int, str] | None = None
        #: The trainers asked to drop the round given up (this client its aggregation client).
        self._dropping: set[str] = set()

    # ----------------------------------------------------------------- the pull

    @contextlib.contextmanager
    def pulling(self, sender: str) -> Iterator[threading.Event]:
        """While a round's model is pulled from ``sender``: the event that stops the pull."""
        stop = threading.Event()
        self._pulling = (sender, stop)
        # Looked at once published: a loss told (or the job ended) before is not missed.
        if self.stopped.is_set() or self.roles.lost_owner(sender):
            stop.set()
        try:
            yield stop
        finally:
            self._pulling = None

    def senders_lost(self, sites: Sequence[str]) -> None:
        """The server lost ``sites``: a pull from one of them cannot end whole any more; stop it."""
        pulling = self._pulling
        if pulling is not None and owner_among(pulling[0], sites):
            pulling[1].set()

    def stop(self) -> None:
        """The job ends: stop the pull in progress."""
        pulling = self._pulling
        if pulling is not None:
            pulling[1].set()

    def lost_soon(self, sender: str, within_s: float) -> bool:
        """Whether the server says ``sender`` is lost, now or within ``within_s`` seconds (the time it
        takes to judge a dead client)."""
        deadline = time.monotonic() + within_s
        while not self.stopped.is_set():
            if self.roles.lost_owner(sender):
                return True
            if time.monotonic() > deadline:
                return False
            self.stopped.wait(0.2)
        return False

    # ----------------------------------------------------------------- the round given up

    def round(self, current_round: int, aggr: str, sender: str, cause: BaseException | None = None) -> bool:
        """Give round ``current_round`` (aggregated by ``aggr``, its model from ``sender``) up; False
        when this client took a later round (it goes on with that one), the final model, or the
        round's model sent again (it takes that one instead) already.

        Raises:
            RuntimeError: The round cannot be given up (`SwarmRoles.untake`), and no later round
                was taken: the job ends with the reason.
        """
        if self._went_on(current_round):
            return False
        with self._lock:
            self.given_up = (current_round, aggr)  # first: what shows the swarm going on is not missed
            self._dropping = set()
        if self.roles.untake(current_round, aggr):
            return True
        self.taken()
        if self._went_on(current_round) or self.roles.aggr_of(current_round) not in (aggr, None):
            return False  # the next round, the final model, or this round played again came meanwhile
        raise RuntimeError(
            f"round {shown_round(current_round)}'s model could not be received: its sender {sender} was lost, and "
            f"{self.site} cannot go back to the round before to have it played again"
        ) from cause

    def _went_on(self, current_round: int) -> bool:
        return self.roles.last_round > current_round or self.roles.final_taken

    def taken(self) -> None:
        """A round's model (or the final model) was taken: nothing is given up any more."""
        with self._lock:
            self.given_up = None
            self._dropping = set()

    def went_on_past(self, sender: str, header: Mapping[str, Any]) -> bool:
        """Whether a round's model this client refused shows the swarm going on past the round after
        the one given up (the next round's model, from the round's aggregation client, is taken).

        Only a well-formed model of such a round, from an aggregation client the server did not
        lose, naming an aggregation client, and not a round played again, counts.
        """
        given_up, number = self.given_up, header.get("round")
        return (
            given_up is not None
            and type(number) is int
            and given_up[0] + 1 < number < self.roles.end_round
            and REPLAY_KEY not in header
            and header.get("aggr") in self.roles.aggr_clients
            and self._from_an_aggregation_client_left(sender)
        )

    def final_went_on_past(self, sender: str, header: Mapping[str, Any]) -> bool:
        """Whether a final model this client refused shows the swarm going on past the round after
        the one given up (after the last round given up, the final model from that round's
        aggregation client is taken): only a well-formed one, of the last round, to a result
        client, from an aggregation client the server did not lose."""
        given_up, last = self.given_up, self.roles.end_round - 1
        return (
            given_up is not None
            and given_up[0] < last
            and type(header.get("round")) is int
            and header["round"] == last
            and self.site in self.roles.result_clients
            and self._from_an_aggregation_client_left(sender)
        )

    def gave_up_own_round(self, current_round: Any) -> bool:
        """Whether ``current_round`` is the round this client aggregates and gave up: a trainer's
        result of it (not a give-up) shows the trainer had its model, and is to drop the round (`to_drop`)."""
        return self.given_up == (current_round, self.site)

    def to_drop(self, trainers: Sequence[str]) -> list[str]:
        """Of ``trainers`` that had the round's model this client (its aggregation client) gave up,
        those not asked yet to drop the round (`SwarmRoles.drop_refusal`); they count as asked now."""
        with self._lock:
            new = [site for site in dict.fromkeys(trainers) if site not in self._dropping]
            self._dropping.update(new)
        return new

    def left_behind(self, evidence: str) -> None:
        """End the job: this client gave a round up, and the swarm went on with it (``evidence``) in a
        way this client cannot follow: past the next round too; or, at the round's aggregation
        client (which has no round's model to apply results to), with a trainer that had the round
        and could not drop it."""
        with self._lock:
            given_up, self.given_up = self.given_up, None
        if given_up is None:
            return
        self.report_error(
            f"{self.site} could not receive round {shown_round(given_up[0])}'s model (its sender was lost) "
            f"while the swarm went on with it: {evidence}"
        )

    def _from_an_aggregation_client_left(self, sender: str) -> bool:
        return owner_among(sender, self.roles.aggr_clients) is not None and self.roles.lost_owner(sender) is None
