"""`SwarmClientController`: a client's part of Swarm learning.

Each round the trainers train the round's model and hand their results to the round's aggregation
client (`ResultHandIn`), which folds them into a weighted sum as they arrive (chunk by chunk, all
at once, with the default weighted mean in memory: `ResultIntake`), applies the aggregate, saves
it, and starts the next round with another aggregation client (`RoundSender`); after the last
round the final model goes to the result clients. Messages go client to client over the cells
(routed through the server cell); tensors are pulled by whoever receives them, from the client
that has them, with the job's chunk sizes. The server never holds a model. A client takes a peer's
message only from the site the config names for it, for the round it expects (`SwarmRoles`). A
round whose model's sender is lost as it is pulled is given up (`GiveUp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.aggregators import Aggregator, ResultRules
from engine.aggregators.rules import marked_from_one_site
from engine.cells import Message, Reply, Status
from engine.errors import AnnouncementRefused, SerializationError
from engine.executors.ccwf.client_side import (
    DEFAULT_STATUS_INTERVAL_S,
    ClientSideController,
    failed,
    owner_among,
    refused,
)
from engine.executors.ccwf.gathering import RoundGathering, in_memory, private_copy
from engine.executors.ccwf.swarm_drop import RoundDrop
from engine.executors.ccwf.swarm_give_up import GiveUp
from engine.executors.ccwf.swarm_hand_in import ResultHandIn
from engine.executors.ccwf.swarm_intake import GAVE_UP_KEY, ResultIntake
from engine.executors.ccwf.swarm_roles import REPLAY_KEY, SwarmRoles
from engine.executors.ccwf.swarm_sending import RoundSender
from engine.fault_points import fault_point
from engine.fobs.quantized import MODES as QUANTIZE_MODES
from engine.model import FLModel, ReservedHeaderKey, ReturnCode, Shareable, model_from_shareable, shown_round
from engine.model.ccwf import (
    CCWF_CHANNEL,
    LOST_KEY,
    LOST_TASK,
    REPLAY_EXCLUDE_KEY,
    REPLAY_ROUND_KEY,
    REPLAY_TASK,
    STARTS_AGAIN_KEY,
)
from engine.model.payload import limits_after, payload_bytes
from engine.model.quantize import quantized_copy
from engine.paths import JobPaths
from engine.persistors import ModelPersistor
from engine.streaming.lazy import cleanup_lazy_refs
from engine.streaming.transactions import LONGEST_WAIT_S

log = logging.getLogger(__name__)

#: Task name prefix of Swarm learning (the server side's).
SWARM_PREFIX = "swarm"
#: Peer topics (after ``<prefix>_``): the round's model to a trainer or the aggregation client,
#: a trainer's result to the aggregation client, the final model to a result client, and the
#: aggregation client's word to a trainer that it gave the round up (`SwarmRoles.drop_refusal`).
LEARN, RESULT, FINAL, DROP = "learn", "result", "final", "drop"
#: Default bound on a round at its aggregation client, in seconds.
DEFAULT_LEARN_TASK_TIMEOUT_S = 3600.0


class SwarmClientController(ClientSideController):
    """Trains, aggregates and passes the model on, as the round requires; route ``swarm_*`` to it.

    Args:
        learn_task_name: The task this client's trainer executor runs (``train``).
        persistor_id: Component that loads the initial model (starting client) and saves each
            aggregated and the final model.
        shareable_generator_id: Component that turns a model into task data and applies an
            aggregate (``engine.workflows.FullModelShareableGenerator``).
        aggregator_id: Component that folds results into the round's weighted sum
            (``engine.aggregators.DXOAggregator``).
        min_responses_required: Results a round needs at its aggregation client.
        wait_time_after_min_resps_received: Seconds to wait for more results once that many
            arrived.
        learn_task_timeout: Seconds a round may take at its aggregation client (None: 3600).
        learn_task_ack_timeout: Seconds a peer has to take the round's model (it acknowledges,
            then pulls the tensors).
        final_result_ack_timeout: Seconds a result client has to pull and save the final model.
        max_concurrent_submissions: Whole results an aggregation client pulls at once in memory
            (each is a model's worth of memory); results folded chunk by chunk (the default
            weighted mean in memory) all go at once, and so do all with ``download_to_disk``.
        request_to_submit_result_msg_timeout: Seconds a trainer waits for the aggregation
            client to take its result.
        request_to_submit_result_interval: Seconds between a trainer's tries when it did not.
        request_to_submit_result_max_wait: Seconds a trainer keeps trying (None: the round's
            ``learn_task_timeout``); then the job ends with the reason.
        download_to_disk: From the config task to the end of the job, tensors this client
            receives go to disk first: results are aggregated one tensor at a time from their
            files, and the training script still gets tensors in memory.
        download_to_disk_dir: Where those downloads go, relative to the client's workspace
            folder (default ``downloads``). It must stay in the workspace or a folder the site
            allows (``flengine run --allow-dir``), symbolic links resolved: checked by
            `use_job_paths` at job start where the runtime calls it, and always at the config
            task, before the first round.
        task_name_prefix: Prefix of the task names (``swarm``).
        allow_non_finite: Aggregate results holding NaN or infinite values (refused by default).
        metric_ranges: Metric name -> ``[low, high]``; a trainer's value outside is dropped.
        quantize: ``"fp16"``, ``"bf16"`` or ``"int8"``: the round's model and the trainers'
            results cross the network quantized, as with `engine.filters.Quantize` between a
            server and its clients (each chunk decoded as it lands; results checked on the
            decoded values). A client's own model and result are used exactly, and the final
            model goes to the result clients exactly. None (the default): everything exact.
    """

    final_phases = frozenset({"done"})  # the final model is saved: a learner's later phase does not undo it

    def __init__(
        self,
        learn_task_name: str = "train",
        persistor_id: str = "persistor",
        shareable_generator_id: str = "shareable_generator",
        aggregator_id: str = "aggregator",
        min_responses_required: int = 1,
        wait_time_after_min_resps_received: float = 10.0,
        learn_task_timeout: float | None = None,
        learn_task_ack_timeout: float = 10.0,
        final_result_ack_timeout: float = 10.0,
        max_concurrent_submissions: int = 1,
        request_to_submit_result_msg_timeout: float = 5.0,
        request_to_submit_result_interval: float = 1.0,
        request_to_submit_result_max_wait: float | None = None,
        download_to_disk: bool = False,
        download_to_disk_dir: str | None = None,
        task_name_prefix: str = SWARM_PREFIX,
        allow_non_finite: bool = False,
        metric_ranges: dict[str, list[float]] | None = None,
        quantize: str | None = None,
    ) -> None:
        super().__init__(task_name_prefix)
        if quantize is not None and quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize: expected one of {', '.join(QUANTIZE_MODES)} or null, got {quantize!r}")
        self.quantize = quantize
        self.rules = ResultRules.from_args(allow_non_finite, metric_ranges)
        if min_responses_required < 1 or max_concurrent_submissions < 1:
            raise ValueError(
                "min_responses_required and max_concurrent_submissions must be >= 1, got "
                f"{min_responses_required} and {max_concurrent_submissions}"
            )
        for name, value in (
            ("wait_time_after_min_resps_received", wait_time_after_min_resps_received),
            ("learn_task_ack_timeout", learn_task_ack_timeout),
            ("final_result_ack_timeout", final_result_ack_timeout),
            ("request_to_submit_result_msg_timeout", request_to_submit_result_msg_timeout),
            ("request_to_submit_result_interval", request_to_submit_result_interval),
        ):
            if value < 0:
                raise ValueError(f"{name}: expected seconds >= 0, got {value}")
        self.learn_task_name = learn_task_name
        self.persistor_id = persistor_id
        self.shareable_generator_id = shareable_generator_id
        self.aggregator_id = aggregator_id
        self.min_responses_required = min_responses_required
        self.wait_time_after_min_resps_received = wait_time_after_min_resps_received
        self.learn_task_timeout = learn_task_timeout or DEFAULT_LEARN_TASK_TIMEOUT_S
        self.learn_task_ack_timeout = learn_task_ack_timeout
        self.final_result_ack_timeout = final_result_ack_timeout
        self.max_concurrent_submissions = max_concurrent_submissions
        self.submit_msg_timeout = request_to_submit_result_msg_timeout
        self.submit_interval = request_to_submit_result_interval
        self.submit_max_wait = request_to_submit_result_max_wait or self.learn_task_timeout
        self.download_to_disk = download_to_disk
        self.download_to_disk_dir = download_to_disk_dir
        self._inbox: queue.Queue[tuple[dict[str, Any], Any]] = queue.Queue()
        self._exits = contextlib.ExitStack()
        self._threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()
        self.intake: ResultIntake | None = None
        self.give_up: GiveUp | None = None
        self.drop: RoundDrop | None = None
        #: Bytes of the last round's model this client held: a peer's next model may announce at
        #: most `limits_after` it (an aggregate is the size of what it was made from); None
        #: before this client held one (a trainer's first round takes the size announced).
        self._model_bytes: int | None = None
        self._status_round_lock = threading.Lock()  # the round reported is read from the roles and sent in one go

    def use_job_paths(self, paths: JobPaths) -> None:
        """Check ``download_to_disk_dir`` (when downloads go to disk) against the folders the site allows.

        Raises:
            PathOutsideError: It leads out of the client's workspace and the folders the site
                allows; the message names ``download_to_disk_dir``.
        """
        if self.download_to_disk and self.download_to_disk_dir is not None:
            paths.resolve_output(self.download_to_disk_dir, "download_to_disk_dir")

    # ----------------------------------------------------------------- config and start

    def configure(self, config: dict[str, Any]) -> Shareable | None:
        self.persistor = self.context.get_component(self.persistor_id, "persistor_id")
        if not isinstance(self.persistor, ModelPersistor):
            raise ValueError(
                f"persistor_id: {self.persistor_id!r} is a {type(self.persistor).__name__}, not a persistor"
            )
        self.aggregator = self.context.get_component(self.aggregator_id, "aggregator_id")
        if not isinstance(self.aggregator, Aggregator):
            raise ValueError(
                f"aggregator_id: {self.aggregator_id!r} is a {type(self.aggregator).__name__}, not an Aggregator"
            )
        self.generator = self.context.get_component(self.shareable_generator_id, "shareable_generator_id")
        if not all(hasattr(self.generator, m) for m in ("learnable_to_shareable", "shareable_to_learnable")):
            raise ValueError(
                f"shareable_generator_id: {self.shareable_generator_id!r} is a {type(self.generator).__name__}, "
                "not a shareable generator"
            )
        self.roles = SwarmRoles.from_config(self.site, config)
        self.give_up = GiveUp(self.site, self.roles, self.stopped, lambda reason: self.update_status(error=reason))
        if config.get("starting_client") and config["starting_client"] != self.site:
            self.persistor.drop_initial_model()  # another client starts the swarm
        if self.download_to_disk:
            if self.context.downloads_to_disk is None:
                raise RuntimeError("download_to_disk: this client runtime cannot download to disk")
            folder = None if self.download_to_disk_dir is None else Path(self.download_to_disk_dir)
            self._exits.enter_context(self.context.downloads_to_disk(folder))
        self.sender = RoundSender(
            self.codec, self.roles, self._topic(LEARN), self._outgoing, self.learn_task_ack_timeout, self._accept_learn
        )
        self.hand_in = ResultHandIn(
            self.codec,
            self.roles,
            self._topic(RESULT),
            self._outgoing,
            self.submit_msg_timeout,
            self.submit_interval,
            self.submit_max_wait,
            self.stopped,
        )
        self.intake = ResultIntake(
            self.codec,
            self.aggregator,
            self.rules,
            list(self.roles.train_clients),
            self.max_concurrent_submissions,
            self.download_to_disk,
            self.site,
        )
        self.drop = RoundDrop(
            self.cell,
            self._topic(DROP),
            self.roles,
            self.give_up,
            self.stopped,
            self._loss_judged_within_s(),
            self.learn_task_ack_timeout,
            self.submit_interval,
            self._spawn,
            self._report_round,
        )
        handlers = (
            (LEARN, self._on_learn),
            (RESULT, self._on_result),
            (FINAL, self._on_final),
            (DROP, self.drop.on_drop),
        )
        for topic, handler in handlers:
            self.cell.register_handler(CCWF_CHANNEL, self._topic(topic), handler)
        self._spawn(self._learn_loop, "learner")
        self.update_status(phase="configured")
        return None

    def start_workflow(self) -> Shareable | None:
        model = self.persistor.load_model()
        self._start_round(self.roles.start_round, model)
        return None

    def handle_task(self, name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        """``lost``: clients the server lost for good (see `_lose`). ``replay``: the server lost a
        round's aggregation client; send the round's model again.

        This client sent the round's model the first time: it aggregated the round before, and
        its persistor's last saved model is that model (`ModelPersistor.load_saved_model`). The
        first round's model is the starting model, read again from the starting checkpoint
        (`ModelPersistor.load_starting_model`), here or, when the server lost the starting
        client, at the aggregation client it chose instead. The model is read now (the task
        fails if it cannot be), and goes to the next aggregation client in turn, past the ones
        the server lost, in the background (each peer may take its time to answer).
        """
        if name == LOST_TASK:
            return self._lose(shareable.get(LOST_KEY), shareable.get(STARTS_AGAIN_KEY))
        if name != REPLAY_TASK:
            return super().handle_task(name, shareable, abort_signal)
        current_round, excluded = shareable.get(REPLAY_ROUND_KEY), shareable.get(REPLAY_EXCLUDE_KEY)
        if type(current_round) is not int or not isinstance(excluded, list):
            raise ValueError(f"the {name} task names no round and no lost clients")
        if self.roles.final_taken:
            raise ValueError(
                f"{self.site} took the final model: its last saved model is not round {current_round + 1}'s"
            )
        model = self._model_to_play_again(current_round)
        lost = set(self.roles.in_swarm([str(site) for site in excluded]))  # a participant may have no role
        log.warning("round %d played again, without %s", current_round + 1, ", ".join(sorted(lost)))

        def replay() -> None:
            try:
                self._start_round(current_round, model, lost)
            except Exception as e:
                log.exception("round %d could not be played again", current_round + 1)
                self.update_status(error=f"round {current_round + 1} played again by {self.site}: {e}")

        self._spawn(replay, f"replay-{current_round}")
        return Shareable()

    def _model_to_play_again(self, current_round: int) -> FLModel:
        """Round ``current_round``'s model as this client sent it, or the starting model for the first round.

        Raises:
            LookupError: The persistor cannot give it back (why, for the task's failure).
        """
        if current_round == self.roles.start_round:
            return self.persistor.load_starting_model()
        return self.persistor.load_saved_model()

    def _lose(self, sites: Any, starts_again: Any = None) -> Shareable:
        """The swarm goes on without ``sites``: no round's model goes to them, no round waits for
        their results (a round open now closes once the others answered), and nothing they send
        is taken. ``starts_again``: the aggregation client the server chose to send the first
        round's model in place of the starting client (`SwarmRoles.starts_again_from`)."""
        new = self.roles.lose(sites)
        if new:
            log.warning("the server lost %s: the swarm goes on without them", ", ".join(new))
            self._intake.lose(new)
            self._give_up.senders_lost(new)
        if starts_again is not None:
            self.roles.starts_again_from(starts_again)
            log.warning("round %s's model comes again from %s", shown_round(self.roles.start_round), starts_again)
        return Shareable()

    def finalize(self) -> None:
        self.stopped.set()
        if self.give_up is not None:
            self.give_up.stop()
        with self._threads_lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(5.0)
        if self.intake is not None:
            self.intake.shutdown()
        self._exits.close()
        super().finalize()

    # ----------------------------------------------------------------- sending a round

    def _start_round(self, current_round: int, model: FLModel, lost: set[str] | None = None) -> None:
        """Send ``model`` as round ``current_round`` (see `RoundSender.send`)."""
        data = self.generator.learnable_to_shareable(model)
        del model
        data.set_header(ReservedHeaderKey.CURRENT_ROUND, current_round)
        data.set_header(ReservedHeaderKey.TOTAL_ROUNDS, self.roles.end_round)
        self._model_bytes = payload_bytes(data)
        self.sender.send(current_round, data, lost)

    def _outgoing(self, data: Shareable) -> Shareable:
        """``data`` as it leaves this client: its params marked to travel quantized when ``quantize`` says so."""
        return data if self.quantize is None else quantized_copy(data, self.quantize)

    # ----------------------------------------------------------------- receiving a round

    def _on_learn(self, message: Message) -> Reply:
        header = dict(message.header)
        why = self.roles.learn_refusal(message.source, header)
        if why:
            if self._give_up.went_on_past(message.source, header):
                self._give_up.left_behind(f"round {shown_round(header['round'])}'s model came from {message.source}")
            return refused(message, why)
        self._accept_learn(header, list(message.frames), [], sender=message.source)
        return Reply(header={})

    def _accept_learn(self, header: dict[str, Any], payload: Any, served: list[str], sender: str | None = None) -> None:
        """Queue the round's model for the learner; ``served``: offers of it that peers are pulling.

        ``sender``: the cell that sent frames (its references must be its own data), already
        admitted by `SwarmRoles.learn_refusal`; None for a model this client made itself.
        """
        current_round = int(header["round"])
        self._give_up.taken()
        if sender is None:
            self.roles.record_learn(current_round, str(header["aggr"]))
        if header["aggr"] == self.site:
            self._round(current_round, header.get(REPLAY_KEY) or ())
        # Reported now, though the learner may still be busy with the round before: the server
        # judges a loss by who holds which round's model.
        self._report_round()
        self._inbox.put((header, payload, served, sender))

    def _report_round(self, **changes: Any) -> None:
        """Report the latest round whose model this client took, and its aggregation client (as the
        roles have them now: a later call never reports an older round, save after `SwarmRoles.untake`)."""
        with self._status_round_lock:
            latest, aggr = self.roles.latest
            self.update_status(round=latest, aggr=aggr, **changes)

    def _learn_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                header, payload, served, sender = self._inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._learn(header, payload, served, sender)
            except Exception as e:
                shown = shown_round(header.get("round"))
                if self.stopped.is_set():  # the job ends: what failed is not wanted any more
                    log.info("round %s ended on %s with the job: %s", shown, self.site, e)
                else:
                    log.exception("round %s failed on %s", shown, self.site)
                    self.update_status(error=f"round {shown} on {self.site}: {type(e).__name__}: {e}")
            del payload

    def _learn(self, header: dict[str, Any], payload: Any, served: list[str], sender: str | None = None) -> None:
        current_round, aggr = int(header["round"]), str(header["aggr"])
        if self.roles.aggr_of(current_round) not in (aggr, None):
            log.info("round %d's model for %s skipped: the round is played again", current_round + 1, aggr)
            return
        if current_round > self.roles.last_round:
            log.info("round %d's model skipped: the round was dropped", current_round + 1)
            return
        trains = self.roles.trains
        self.hand_in.drop_held(current_round)
        self._report_round(phase="receiving")
        if isinstance(payload, Shareable):
            data = payload
        else:
            data = self._receive(current_round, aggr, payload, sender)
            if data is None:
                return
        del payload
        if aggr == self.site:  # the round's model, as sent: results are checked against it as they come
            self._round(current_round).set_base(data)
        if trains and served:
            data = self._train_after_peers(data, served)
        if not trains:
            self.update_status(phase="aggregating" if aggr == self.site else "idle")
            return
        self.update_status(phase="training")
        result = self.context.run_task(self.learn_task_name, Shareable(data), self.stopped)  # type: ignore[misc]
        if aggr != self.site:  # the aggregation client keeps the round's model (and its files)
            cleanup_lazy_refs(data)
        del data
        if current_round > self.roles.last_round:
            log.warning("round %d's result not handed in: the round was dropped", current_round + 1)
            self.update_status(phase="idle")
            return
        result.set_header(ReservedHeaderKey.CURRENT_ROUND, current_round)
        self.update_status(phase="submitting")
        if aggr == self.site:
            entry = self._round(current_round)
            if entry.claim(self.site):
                self._intake.take_own(entry, self.site, result)
        else:
            self.hand_in.submit(aggr, current_round, result)
        self.update_status(phase="idle")

    def _receive(self, current_round: int, aggr: str, payload: Any, sender: str | None) -> Shareable | None:
        """Pull the round's model from ``sender``; None when the server lost the sender first.

        The round is then given up here as if its model never came (`SwarmRoles.untake`), so that
        the server, seeing every client back at the round before, has that one played again; or,
        when another client had the model whole and the swarm goes on with the round, this client
        takes the next round's model from the round's aggregation client and misses one round.
        When this client is the round's aggregation client, the trainers that had the model drop
        the round too (`RoundDrop.ask`), and the round before is played again.

        Raises:
            StreamingError: The pull failed, and the server did not lose the sender (at once when
                the sender's announcement was refused: `AnnouncementRefused`).
            SerializationError: The message is malformed (at once).
            RuntimeError: The server lost the sender, and the round cannot be given up
                (`GiveUp.round`).
        """
        with self._give_up.pulling(str(sender)) as stop:
            try:
                limits = limits_after(self._model_bytes, f"round {current_round + 1}'s model from {sender}")
                data = self.codec.decode(payload, sender=sender, stop=stop, **limits)
            except Exception as e:
                # A refused announcement or a malformed message is the sender's doing: no loss to wait for.
                if (
                    self.stopped.is_set()
                    or sender is None
                    or isinstance(e, (AnnouncementRefused, SerializationError))
                    or not self._give_up.lost_soon(sender, self._loss_judged_within_s())
                ):
                    raise
                shown = shown_round(current_round)
                if current_round > self.roles.last_round:  # dropped meanwhile (`RoundDrop.on_drop`)
                    log.warning("round %s's model not received: the round was dropped", shown)
                    return None
                if not self._give_up.round(current_round, aggr, sender, e):  # it took a later round: that one goes on
                    log.warning("round %s's model not received (its sender %s was lost); going on", shown, sender)
                    return None
                log.warning("round %s's model not received: the server lost its sender %s", shown, sender)
                self._report_round(phase="idle")
                if aggr == self.site:
                    had_it = self._intake.abandon(current_round)
                    if had_it:  # they drop the round too, so that the round before is played again
                        self._drop.ask(had_it, current_round)
                elif self.roles.trains:  # the round's aggregation client waits for no result of this client
                    result = failed(ReturnCode.EXECUTION_EXCEPTION, f"{e}"[:300])
                    self.hand_in.submit(aggr, current_round, result, gave_up=True)
                return None
        self._model_bytes = payload_bytes(data)
        return data

    @property
    def _give_up(self) -> GiveUp:
        assert self.give_up is not None, "the config task has not run"
        return self.give_up

    @property
    def _drop(self) -> RoundDrop:
        assert self.drop is not None, "the config task has not run"
        return self.drop

    def _loss_judged_within_s(self) -> float:
        """How long the server takes to say a dead client is lost: the heartbeat timeout and three status intervals."""
        interval_s = float(self.config.get("status_interval", DEFAULT_STATUS_INTERVAL_S))
        return self.cell.settings.heartbeat_timeout_s + 3 * interval_s

    def _train_after_peers(self, data: Shareable, served: list[str]) -> Shareable:
        """This client's own round model, once the peers have pulled theirs from the same tensors.

        A training script may change its model in place, and the peers must get it unchanged.
        Waiting costs no round time (the peers cannot train before they have it) and no memory;
        a peer that stops pulling for ``learn_task_ack_timeout`` seconds, or has not finished
        after `LONGEST_WAIT_S`, gets this client a copy to train instead.
        """
        self.update_status(phase="serving")
        idle_limit_s = max(self.learn_task_ack_timeout, 1.0)
        if self.codec.context.sending_service.wait_finished(served, idle_limit_s, self.stopped):
            return data
        log.warning(
            "peers did not finish pulling the round's model (no request for %.0f s, or %.0f s in all); training a copy",
            idle_limit_s,
            LONGEST_WAIT_S,
        )
        return private_copy(data)

    # ----------------------------------------------------------------- aggregating a round

    @property
    def _intake(self) -> ResultIntake:
        assert self.intake is not None, "the config task has not run"
        return self.intake

    def _round(self, current_round: int, lost: Sequence[str] = ()) -> RoundGathering:
        """The round this client aggregates (made, and its gathering thread started, on first use).

        ``lost``: the trainers a round played again goes without (its model's `REPLAY_KEY`).
        """
        return self._intake.round(
            current_round, lambda e: self._spawn(lambda: self._gather(e), f"round-{e.number}"), lost
        )

    def _on_result(self, message: Message) -> Reply:
        """A trainer's result: taken once a round, from a train client, for a round this client aggregates."""
        why = self.roles.result_refusal(message.source, message.header)
        if why:
            return refused(message, why)
        site = owner_among(message.source, self.roles.train_clients)
        assert site is not None  # result_refusal checked it
        current_round = message.header.get("round")
        if self._give_up.gave_up_own_round(current_round) and message.header.get(GAVE_UP_KEY) is not True:
            self._drop.ask([site], current_round)  # the trainer had the round's model: it drops the round too
            return refused(
                message, f"{self.site} gave round {shown_round(current_round)} up: its model never came whole"
            )
        return self._intake.on_result(message, site)

    def _gather(self, entry: RoundGathering) -> None:
        try:
            if not entry.wait_done(
                self.min_responses_required,
                self.wait_time_after_min_resps_received,
                self.learn_task_timeout,
                self.stopped,
            ):
                return
            settings = f"learn_task_timeout={self.learn_task_timeout:g} s"
            self._intake.close(entry, self.min_responses_required, settings)
            self._finish_round(entry)
        except Exception as e:
            log.exception("round %d could not be aggregated on %s", entry.number + 1, self.site)
            self.update_status(error=f"round {entry.number + 1} at aggregation client {self.site}: {e}")
        finally:
            entry.release()
            self._intake.end(entry)

    def _finish_round(self, entry: RoundGathering) -> None:
        self.update_status(round=entry.number, aggr=self.site, phase="aggregating")
        aggregate = self._intake.aggregator_of(entry).aggregate(entry.number)
        self._intake.release_round(entry)  # the trainers may free their results
        base = model_from_shareable(entry.base) if entry.base is not None else FLModel(params={})
        model = self.generator.shareable_to_learnable(aggregate, base)
        del aggregate, base
        model = dataclasses.replace(model, params=in_memory(model.params or {}))
        entry.release()
        # no persistor (here, or a result client's for the final model) picks a best model by a
        # metric one trainer alone decided
        from_one_site = entry.metrics_from_one_site(len(self.roles.train_clients))
        model = marked_from_one_site(model, from_one_site)
        self.persistor.save_model(model)
        done = {
            "round": entry.number,
            "time_s": round(time.monotonic() - entry.started, 3),
            "metrics": dict(model.metrics or {}),
            "clients": sorted(entry.accepted),
            "aggregator": self.site,
            **({"metrics_from_one_site": from_one_site} if from_one_site else {}),
        }
        self.update_status(rounds_done=[*self.status.rounds_done, done])
        folded = len(entry.fold.folded) if entry.fold is not None else 0
        log.info("round aggregated round=%d results=%d folded=%d", entry.number + 1, len(entry.accepted), folded)
        following = entry.number + 1
        if following < self.roles.end_round:
            self._start_round(following, model)
            self.update_status(phase="idle")
            return
        self._distribute_final(model)
        self.update_status(phase="done", all_done=True)

    # ----------------------------------------------------------------- the final model

    def _distribute_final(self, model: FLModel) -> None:
        """Send the final model to every result client; each pulls and saves it before answering."""
        others = [site for site in self.roles.result_clients if site != self.site and site not in self.roles.lost]
        data = self.generator.learnable_to_shareable(model)
        frames = self.codec.encode(data, receivers=others) if others else []
        replies = self.cell.broadcast(
            others,
            CCWF_CHANNEL,
            self._topic(FINAL),
            {"round": self.roles.end_round - 1},
            frames,
            self.final_result_ack_timeout,
        )
        for site, reply in replies.items():
            if reply.status is not Status.OK:
                log.warning("final model not saved by %s: %s %s", site, reply.status.value, reply.reason)
        fault_point("swarm_final_sent", settle_s=0.5)  # the fault suite's hook: the swarm not yet reported done
        self.persistor.flush()

    def _on_final(self, message: Message) -> Reply:
        """The final model: saved once, on a result client, from the last round's aggregation client."""
        why = self.roles.final_refusal(message.source, message.header)
        if why:
            if self._give_up.final_went_on_past(message.source, message.header):
                self._give_up.left_behind(f"the final model came from {message.source}")
            return refused(message, why)
        data = None
        try:
            limits = limits_after(self._model_bytes, f"the final model from {message.source}")
            data = self.codec.decode(list(message.frames), sender=message.source, stop=self.stopped, **limits)
            model = model_from_shareable(data)
            self.persistor.save_model(dataclasses.replace(model, params=in_memory(model.params or {})))
            self.persistor.flush()
        except Exception as e:  # answered, never raised into the cell's pool
            self.roles.final_failed()
            return refused(message, f"the final model could not be saved: {type(e).__name__}: {e}")
        finally:
            cleanup_lazy_refs(data)
        self._give_up.taken()  # a last round given up: the swarm finished it without this client
        self.update_status(phase="done")
        return Reply(header={})

    # ----------------------------------------------------------------- helpers

    def _topic(self, name: str) -> str:
        return f"{self.task_name_prefix}_{name}"

    def _spawn(self, target: Any, name: str) -> None:
        """Run ``target`` on a thread that `finalize` joins (called by the learner and the cell's handlers)."""
        thread = threading.Thread(target=target, name=f"{self.site}-{name}", daemon=True)
        with self._threads_lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
