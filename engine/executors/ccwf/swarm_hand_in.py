"""`ResultHandIn`: how a Swarm trainer hands its result to the round's aggregation client.

The trainer offers the result (its header and the download's frames); the aggregation client
pulls the tensors when it can. A refusal ends the offer; a timeout or an unreachable peer is tried
again every ``interval_s`` until ``max_wait_s``, unless the swarm left the round meanwhile (it was
played again with another aggregation client, the server lost the aggregation client, this
trainer dropped the round, or it took a later round's model) or the aggregation client is gone:
the result is then dropped instead of ending the job. An offer the aggregation client may pull
again until its round ends (it folds chunks as they land, and may have to rebuild its sum) is
*held* past its timeout, and freed when this trainer takes a later round's model.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.cells.retry import Absence
from engine.errors import CellError, CellRemoteError, CellUnreachableError
from engine.executors.ccwf.swarm_intake import GAVE_UP_KEY, HELD_KEY
from engine.executors.ccwf.swarm_roles import SwarmRoles
from engine.model import ReturnCode, Shareable
from engine.model.ccwf import CCWF_CHANNEL
from engine.streaming.codec import MessageCodec

log = logging.getLogger(__name__)


class ResultHandIn:
    """Offers a trainer's results to their rounds' aggregation clients, and frees them once not wanted.

    Args:
        codec: The client's codec (the offer's frames and the download behind them).
        roles: The swarm as this client sees it (which round it is in, whom the server lost).
        topic: The cell topic of results (``swarm_result``).
        outgoing: The result as it leaves this client (quantized when the job says so).
        msg_timeout_s: Seconds the aggregation client has to take an offer.
        interval_s: Seconds between two tries.
        max_wait_s: Seconds to keep trying.
        stopped: Set when the job ends.
    """

    def __init__(
        self,
        codec: MessageCodec,
        roles: SwarmRoles,
        topic: str,
        outgoing: Callable[[Shareable], Shareable],
        msg_timeout_s: float,
        interval_s: float,
        max_wait_s: float,
        stopped: threading.Event,
    ) -> None:
        self.codec = codec
        self.roles = roles
        self.topic = topic
        self.outgoing = outgoing
        self.msg_timeout_s = msg_timeout_s
        self.interval_s = interval_s
        self.max_wait_s = max_wait_s
        self.stopped = stopped
        # (round, offers) the aggregation clients may pull again; the learner thread alone uses it
        self._held: list[tuple[int, list[str]]] = []

    def submit(self, aggr: str, current_round: int, result: Shareable, gave_up: bool = False) -> None:
        """Offer the result of round ``current_round`` to ``aggr``; return once it is taken, refused or dropped.

        ``gave_up``: the result says this trainer gave the round up (its model never reached it whole).

        Raises:
            RuntimeError: ``aggr`` did not take it within ``max_wait_s`` though it answers
                heartbeats: the round cannot be aggregated, and the swarm ends with the reason
                instead of waiting.
        """
        cell, service = self.codec.context.cell, self.codec.context.sending_service
        offers: list[str] = []
        frames = self.codec.encode(self.outgoing(result), receivers=[aggr], offers=offers)
        header = {"round": current_round, "ok": result.get_return_code() is ReturnCode.OK}
        if gave_up:
            header[GAVE_UP_KEY] = True
        deadline = time.monotonic() + self.max_wait_s
        away = Absence(cell.settings.heartbeat_timeout_s)
        while not self.stopped.is_set():
            moved = self.roles.aggr_of(current_round) not in (aggr, None)  # the round was played again
            dropped = not gave_up and self.roles.last_round < current_round  # `SwarmRoles.drop_refusal`
            if moved or dropped or aggr in self.roles.lost:
                why = "the round went to another" if moved else "the server lost it"
                why = "the round was dropped" if dropped else why
                log.warning("round %d: result for %s not handed in: %s", current_round + 1, aggr, why)
                service.drop(offers)
                return
            try:
                reply = cell.request(aggr, CCWF_CHANNEL, self.topic, header, frames, self.msg_timeout_s)
                if reply.header.get(HELD_KEY) is True:
                    service.hold(offers)
                    self._held.append((current_round, offers))
                return
            except CellRemoteError as e:  # taken and refused (the round closed): nothing to retry
                log.warning("round %d: %s refused the result: %s", current_round + 1, aggr, e)
                return
            except CellError as e:
                now = time.monotonic()
                gone = ""
                if not isinstance(e, CellUnreachableError) or not cell.connected:
                    away.heard()  # it is there, only slow; or this site's own link is down
                elif (away_s := away.unreachable(now)) > away.limit_s:
                    gone = f"unreachable for {away_s:.1f} s, more than the heartbeat timeout of {away.limit_s:g} s"
                if self.roles.last_round > current_round or gone:
                    # The swarm left the round, or the server will play it again (or end the job)
                    # without the aggregation client: the result is not wanted any more.
                    why = gone and f"aggregation client {aggr} is gone ({gone})"
                    log.warning("round %d: result not handed in: %s", current_round + 1, why or "the swarm is past it")
                    service.drop(offers)
                    return
                if now > deadline:
                    raise RuntimeError(
                        f"could not hand the result to aggregation client {aggr} within "
                        f"request_to_submit_result_max_wait={self.max_wait_s:g} s: {e}"
                    ) from e
                log.warning("round %d: %s did not take the result yet: %s", current_round + 1, aggr, e)
                self.stopped.wait(self.interval_s)

    def drop_held(self, current_round: int) -> None:
        """Free results held for rounds up to ``current_round``: this client took round
        ``current_round``'s model, so those rounds are over (or, for that round itself, played again);
        and for rounds past the last it took, which it dropped (`SwarmRoles.drop_refusal`)."""
        last = self.roles.last_round
        ended = [offers for number, offers in self._held if not current_round < number <= last]
        self._held = [(number, offers) for number, offers in self._held if current_round < number <= last]
        for offers in ended:
            self.codec.context.sending_service.drop(offers)
