"""`RoundSender`: how a Swarm client sends a round's model to the round's aggregation client and trainers.

The aggregation client is the first in turn (`engine.model.ccwf.rotate`) that takes the model
within ``ack_timeout_s``; the trainers get it next. Each receiver acknowledges, then pulls the
tensors from this client when it can (one download, offered to all of them). Clients the server
lost for good get nothing, and so do those a round played again goes without.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from engine.errors import CellError
from engine.executors.ccwf.swarm_roles import AGGR_KEY, REPLAY_KEY, ROUND_KEY, SwarmRoles
from engine.fault_points import fault_point
from engine.model import Shareable, shown_round
from engine.model.ccwf import CCWF_CHANNEL, rotate
from engine.streaming.codec import MessageCodec

log = logging.getLogger(__name__)

#: ``accept_own(header, data, offers)``: this client takes the round's model it sends itself
#: (``offers``: the download its peers pull it from).
AcceptOwn = Callable[[dict[str, Any], Shareable, list[str]], None]


class RoundSender:
    """Sends rounds' models from this client to their aggregation client and trainers.

    Args:
        codec: The client's codec (the messages' frames and the download behind them).
        roles: The swarm as this client sees it (who trains and aggregates, whom the server lost).
        topic: The cell topic of a round's model (``swarm_learn``).
        outgoing: The model as it leaves this client (quantized when the job says so).
        ack_timeout_s: Seconds a receiver has to take the model (``learn_task_ack_timeout``).
        accept_own: Called when this client is one of the receivers.
    """

    def __init__(
        self,
        codec: MessageCodec,
        roles: SwarmRoles,
        topic: str,
        outgoing: Callable[[Shareable], Shareable],
        ack_timeout_s: float,
        accept_own: AcceptOwn,
    ) -> None:
        self.codec = codec
        self.roles = roles
        self.topic = topic
        self.outgoing = outgoing
        self.ack_timeout_s = ack_timeout_s
        self.accept_own = accept_own

    def send(self, current_round: int, data: Shareable, lost: Collection[str] | None = None) -> None:
        """Send ``data`` as round ``current_round``'s model.

        ``lost``: the round is played again (its first aggregation client was lost): these clients
        get nothing, and the model says it is sent again (`REPLAY_KEY`).

        Raises:
            RuntimeError: No aggregation client took it (or every one is lost).
        """
        site, service = self.roles.site, self.codec.context.sending_service
        skipped = {*(lost or ()), *self.roles.lost}
        trainers = [trainer for trainer in self.roles.train_clients if trainer not in skipped]
        unreachable: list[str] = []
        candidates = [aggr for aggr in rotate(list(self.roles.aggr_clients), current_round) if aggr not in skipped]
        fault_point("swarm_round_sending", settle_s=0.5)  # the fault suite's hook: the round's model only here
        for aggr in candidates:
            header: dict[str, Any] = {ROUND_KEY: current_round, AGGR_KEY: aggr}
            if lost is not None:
                header[REPLAY_KEY] = sorted(lost)
            peers = [peer for peer in dict.fromkeys([aggr, *trainers]) if peer != site]
            offers: list[str] = []
            frames = self.codec.encode(self.outgoing(data), receivers=peers, offers=offers) if peers else []
            if self._deliver(aggr, header, data, frames, offers):
                break
            unreachable.append(aggr)
            service.drop_receiver(offers, aggr)
        else:
            if not candidates:
                raise RuntimeError(f"round {current_round + 1}: every aggregation client is lost")
            raise RuntimeError(
                f"round {current_round + 1}: no aggregation client took the model "
                f"(aggr_clients: {', '.join(candidates)}; {self.ack_timeout_s:g} s each)"
            )
        for trainer in trainers:
            if trainer != aggr and not self._deliver(trainer, header, data, frames, offers):
                unreachable.append(trainer)
                service.drop_receiver(offers, trainer)
        if unreachable:
            log.warning("round %d: not delivered to %s", current_round + 1, ", ".join(unreachable))
        log.info("round started round=%d aggr=%s trainers=%s", current_round + 1, aggr, trainers)

    def _deliver(
        self, receiver: str, header: dict[str, Any], data: Shareable, frames: list[Any], offers: list[str]
    ) -> bool:
        """Hand the round's model to ``receiver``: straight to `accept_own` when it is this client."""
        if receiver == self.roles.site:
            self.accept_own(header, data, offers)
            return True
        try:
            self.codec.context.cell.request(
                receiver, CCWF_CHANNEL, self.topic, header, frames, timeout_s=self.ack_timeout_s
            )
            return True
        except CellError as e:
            log.warning("round %s not taken by %s: %s", shown_round(header[ROUND_KEY]), receiver, e)
            return False
