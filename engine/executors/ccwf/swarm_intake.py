"""`ResultIntake`: how a Swarm aggregation client takes in its trainers' results.

In memory (no ``download_to_disk``) with the default weighted mean (a `DXOAggregator` that has a
`DXOAggregator.folding_twin`), each round folds its results into a `FoldingModelAggregator`
chunk by chunk as they land, all trainers at once: a result's weight is in its meta, which comes
before its tensors, so no result is ever whole in memory. Before the first chunk is pulled, the
result's header is checked (its round and DXO kind, the weight bound, a second result) and then
its layout (names, shapes and dtypes those of the round's model); each piece of a tensor is
checked finite before it is added. A refusal there costs nothing: the sum is untouched.

A result that fails after some of its chunks were folded (its trainer died, a NaN in a later
tensor, the round closed first) cannot be taken back out of a float32 sum. Its trainer keeps
serving every folded result until the round's mean is made (the download is *held*: the
trainer is told so in the reply and keeps its offer past its timeout), so at the round's end
`FoldingModelAggregator.rebuild` makes the sum again from the committed results alone, pulling
each once more; the round never uses a sum with part of a failed result in it.

Everything else takes the whole-result path, unchanged: another aggregator (robust or custom,
a subclass, ``exclude_vars``), downloads to disk, results whose params do not all stream as torch
tensors (those still go into the round's sum, whole, at most ``max_concurrent_submissions`` at a
time), and a round whose model this client does not hold yet.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from engine.aggregators import Aggregator, DXOAggregator, ModelAggregatorAsDXO, ResultRules
from engine.aggregators.check import check_params_match
from engine.aggregators.dxo_aggregator import acceptable_dxo
from engine.aggregators.folding import FoldingModelAggregator, ResultFold
from engine.aggregators.refusals import bug_reason
from engine.cells import Cell, Message, Reply
from engine.errors import ResultRefused, WorkflowError
from engine.executors.ccwf.client_side import refused
from engine.executors.ccwf.gathering import LOST, RoundGathering
from engine.model import DXO, DataKind, FLModel, ParamsType, ReturnCode, Shareable, shown_round
from engine.model.payload import limits_after, payload_bytes
from engine.streaming.codec import MessageCodec
from engine.streaming.lazy import cleanup_lazy_refs
from engine.streaming.pull import HeldDownload, release_held
from engine.streaming.via_downloader import StreamedItem

log = logging.getLogger(__name__)

#: Concurrent result downloads of an aggregation client that downloads to disk.
DISK_PULLS = 8
#: A result waits at most this long for the round's model to reach the aggregation client, which
#: checks the result against it (names, shapes, dtypes; its size) before pulling it.
BASE_WAIT_S = 60.0
#: Key of the reply to a trainer's result: True when the aggregation client may pull the result
#: again until its round ends (the trainer keeps serving it past the offer's timeout).
HELD_KEY = "held"
#: Key of a trainer's (failed) result header: True when it gave the round up, its model's sender
#: lost before the model reached it whole.
GAVE_UP_KEY = "gave_up"

_PARAMS_TYPES = {DataKind.WEIGHTS: ParamsType.FULL, DataKind.WEIGHT_DIFF: ParamsType.DIFF}


class _Held:
    """One result's downloads whose senders were not told they are done (they keep serving them)."""

    def __init__(self, cell: Cell) -> None:
        #: Filled by the downloads (`MessageCodec.decode` with ``held``), from any thread.
        self.entries: list[HeldDownload] = []
        self._cell = cell
        self._told: set[HeldDownload] = set()
        self._lock = threading.Lock()

    def release(self) -> None:
        """Tell the senders they may free them; each sender is told once (a later call tells only new ones)."""
        with self._lock:
            fresh = [entry for entry in dict.fromkeys(self.entries) if entry not in self._told]
            self._told.update(fresh)
        if fresh:
            release_held(self._cell, fresh)


@dataclasses.dataclass(eq=False)
class RoundFold:
    """A round folded chunk by chunk: its sums, their DXO face, the downloads it holds."""

    sums: FoldingModelAggregator
    kind: DataKind
    view: Aggregator = dataclasses.field(init=False)
    held: list[_Held] = dataclasses.field(default_factory=list)
    #: Results folded chunk by chunk (pulled as streams, or the aggregation client's own).
    folded: list[str] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.view = ModelAggregatorAsDXO(self.sums, self.kind.value)

    def keep(self, held: _Held) -> None:
        with self._lock:
            self.held.append(held)

    def release(self) -> None:
        """Let every trainer free its result (the round's mean is made, or the round failed)."""
        with self._lock:
            held, self.held = self.held, []
        for entry in held:
            entry.release()


class ResultIntake:
    """Pulls the trainers' results of the rounds this client aggregates, folding them where it can.

    Args:
        codec: The client's codec (its cell pulls the results).
        aggregator: The swarm's aggregator (``aggregator_id``).
        rules: The checks of every result.
        trainers: The swarm's ``train_clients``.
        max_concurrent_submissions: Whole results pulled into memory at once.
        download_to_disk: Whether results download to disk (then all are whole, 8 at once).
        site: This client's name (for thread names).
    """

    def __init__(
        self,
        codec: MessageCodec,
        aggregator: Aggregator,
        rules: ResultRules,
        trainers: list[str],
        max_concurrent_submissions: int,
        download_to_disk: bool,
        site: str,
    ) -> None:
        self.codec = codec
        self.aggregator = aggregator
        self.rules = rules
        #: Whether the rounds fold their results chunk by chunk.
        self.folds = not download_to_disk and _twin_of(aggregator) is not None
        if download_to_disk:
            workers = DISK_PULLS
        elif self.folds:  # every trainer's result at once; whole ones wait for a memory slot
            workers = max(max_concurrent_submissions, len(trainers))
        else:
            workers = max_concurrent_submissions
        self._slots = threading.BoundedSemaphore(max_concurrent_submissions)
        self._pulls = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"{site}-pull")
        self.site = site
        self.trainers = list(trainers)
        self._rounds: dict[int, RoundGathering] = {}
        self._rounds_lock = threading.Lock()
        self._lost: set[str] = set()  # trainers the server lost for good: no round waits for them
        self._closed_up_to = -1  # rounds up to this one take no more results
        self._stopping = threading.Event()  # set by `shutdown`: a rebuild then stops pulling
        self._refused_sites: set[str] = set()  # sites whose result the checks refused while it streamed
        # Sites refused midway once (the sum had to be rebuilt): their results are taken whole
        # from then on, so a trainer cannot make every other result be pulled twice each round.
        self._whole_from: set[str] = set()

    @property
    def cell(self) -> Cell:
        return self.codec.context.cell

    # ----------------------------------------------------------------- the rounds this client aggregates

    def round(
        self, current_round: int, started: Callable[[RoundGathering], None], lost: Sequence[str] = ()
    ) -> RoundGathering:
        """Round ``current_round`` (made on first use, with its own folding sums when the rounds fold).

        Args:
            current_round: The round.
            started: Called once with a round just made (to start its gathering thread).
            lost: Trainers the round is played without (it is played again after a loss).
        """
        with self._rounds_lock:
            entry = self._rounds.get(current_round)
            if entry is None:
                entry = RoundGathering(current_round, [site for site in self.trainers if site not in lost])
                entry.lose(self._lost)
                if self._stopping.is_set():  # made after `shutdown` looked at the rounds
                    entry.pulls_stop.set()
                twin = _twin_of(self.aggregator) if self.folds else None
                if twin is not None:
                    assert isinstance(self.aggregator, DXOAggregator)
                    entry.fold = RoundFold(twin, self.aggregator.expected_data_kind)
                self._rounds[current_round] = entry
                started(entry)
            return entry

    def lose(self, sites: Sequence[str]) -> None:
        """Expect no result from ``sites`` any more (the server lost them): neither in the rounds to
        come nor in those open now, unless their result is already coming."""
        with self._rounds_lock:
            self._lost.update(sites)
            entries = list(self._rounds.values())
        for entry in entries:
            entry.lose(sites)

    def on_result(self, message: Message, site: str) -> Reply:
        """A result of train client ``site`` (already admitted by its role): pulled in the pool, or refused.

        The reply says whether the result may be pulled again until its round ends (`HELD_KEY`).
        """
        current_round = int(message.header["round"])
        with self._rounds_lock:
            entry = self._rounds.get(current_round)
            closed = current_round <= self._closed_up_to
        if entry is None or entry.closed:
            if closed or entry is not None:
                return refused(message, f"round {current_round + 1} is closed at {self.site}: the result came too late")
            return refused(message, f"{self.site} does not aggregate round {current_round + 1}")
        if not entry.claim(site):
            if entry.failed.get(site) == LOST:
                return refused(message, f"the server lost {site}: round {current_round + 1} takes no result of it")
            return refused(message, f"{site} already sent its result for round {current_round + 1}")
        if message.header.get(GAVE_UP_KEY) is True:
            entry.given_up_by(site)
            return Reply(header={})
        if not message.header.get("ok", True):
            entry.fail(site, "the trainer's task failed")
            return Reply(header={})
        self._pulls.submit(self._pull, entry, site, list(message.frames), message.source)
        return Reply(header={HELD_KEY: isinstance(entry.fold, RoundFold)})

    def aggregator_of(self, entry: RoundGathering) -> Aggregator:
        """The aggregator round ``entry`` goes into: its folding sums, or the swarm's aggregator."""
        return entry.fold.view if isinstance(entry.fold, RoundFold) else self.aggregator

    # ----------------------------------------------------------------- a trainer's result

    def _pull(self, entry: RoundGathering, site: str, frames: list[Any], sender: str) -> None:
        # Nothing is pulled before the round's model is here: a result is checked against it,
        # and may announce no more than `limits_after` its bytes.
        base = entry.wait_base(self._stopping, BASE_WAIT_S)
        if base is None:
            reason = f"round {entry.number + 1}'s model did not reach {self.site} within {BASE_WAIT_S:g} s"
            log.warning("round %d: result of %s refused: %s", entry.number + 1, site, reason)
            entry.fail(site, f"the result cannot be checked: {reason}")
            return
        model_bytes = payload_bytes(base)
        limits = limits_after(model_bytes, f"a result of {site}")
        state = entry.fold
        if not isinstance(state, RoundFold):
            self._pull_whole(entry, site, frames, sender, base, limits)
            return
        opened: list[ResultFold] = []
        held = _Held(self.cell)
        state.keep(held)
        slot: list[bool] = []

        def fold(peeked: Any) -> ResultFold | None:
            result_fold = self._open_fold(entry, state, site, peeked)
            if result_fold is None:  # taken whole: one of the memory slots
                self._slots.acquire()
                slot.append(True)
            else:
                opened.append(result_fold)
            return result_fold

        result = None
        try:
            result = self.codec.decode(
                frames, sender=sender, fold=fold, held=held.entries, stop=entry.pulls_stop, **limits
            )
            if not opened:  # taken whole: it will not be pulled again
                held.release()
            if not isinstance(result, Shareable):
                raise TypeError(f"expected a Shareable, got {type(result).__name__}")
            for result_fold in opened:
                result_fold.refold = _refold_from(self.codec, frames, sender, held, limits)
                result_fold.release = held.release
            self._check_against_base(base, site, result)
            entry.take(site, result, state.view, self.rules)
            if opened and site in entry.accepted:
                state.folded.append(site)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            log.warning("round %d: result of %s refused: %s", entry.number + 1, site, e)
            for result_fold in opened:  # before the round hears of it: the sum's taint names the reason
                result_fold.fail(reason)
            entry.fail(site, reason)
        finally:
            if slot:
                self._slots.release()
            for result_fold in opened:  # nothing when it was committed; taints the sum if it folded anything
                result_fold.fail(f"the result of {site} was not taken")
            if site not in entry.accepted:
                held.release()
            cleanup_lazy_refs(result)

    def _pull_whole(
        self, entry: RoundGathering, site: str, frames: list[Any], sender: str, base: Shareable, limits: dict[str, Any]
    ) -> None:
        result = None
        try:
            result = self.codec.decode(frames, sender=sender, stop=entry.pulls_stop, **limits)
            if not isinstance(result, Shareable):
                raise TypeError(f"expected a Shareable, got {type(result).__name__}")
            self._check_against_base(base, site, result)
            entry.take(site, result, self.aggregator, self.rules)
        except Exception as e:
            log.warning("round %d: result of %s refused: %s", entry.number + 1, site, e)
            entry.fail(site, f"{type(e).__name__}: {e}")
        finally:
            cleanup_lazy_refs(result)

    def _check_against_base(self, base: Shareable, site: str, result: Shareable) -> None:
        """Refuse a result whose names, shapes or dtypes are not those of the round's model ``base``.

        A result folded chunk by chunk had its layout checked before its first chunk; one taken
        whole (its values inline or numpy arrays) is checked here.

        Raises:
            ResultRefused: It does not match.
        """
        try:
            dxo, reference = DXO.from_shareable(result), DXO.from_shareable(base).data
        except ValueError:
            return  # no DXO: refused by the round's checks
        data = dxo.data
        if dxo.data_kind != DataKind.METRICS and isinstance(data, Mapping) and isinstance(reference, Mapping):
            check_params_match({name: reference[name] for name in data if name in reference}, data, site)

    def _open_fold(self, entry: RoundGathering, state: RoundFold, site: str, peeked: Any) -> ResultFold | None:
        """The fold of a result known by its header alone, or None to take it whole.

        Raises:
            ResultRefused: The result is refused before anything is pulled (another round or DXO
                kind, a weight out of bounds, a second result, the round closed).
        """
        if not isinstance(peeked, Shareable) or peeked.get_return_code() is not ReturnCode.OK:
            return None  # refused whole, as before
        if site in self._whole_from:
            return None
        dxo = acceptable_dxo(peeked, entry.number, state.kind)
        items = _streamed_items(dxo.data)
        reference = _layout_of_base(entry)
        if items is None or reference is None:
            return None
        header = FLModel(params_type=_PARAMS_TYPES[state.kind], meta=dict(dxo.meta))

        def check_layout(params: dict[str, torch.Tensor]) -> None:
            check_params_match({name: reference[name] for name in params if name in reference}, params, site)

        def check_tensor(name: str, values: torch.Tensor) -> None:
            try:
                self.rules.check_values({name: values}, site)
            except ResultRefused:
                self._refused_sites.add(site)
                raise

        return state.sums.open_result(header, site, items, check_layout, check_tensor)

    # ----------------------------------------------------------------- the aggregation client's own result

    def take_own(self, entry: RoundGathering, site: str, result: Shareable) -> None:
        """Fold this client's own result (in memory already) into its round."""
        state = entry.fold
        params = _own_tensors(result) if isinstance(state, RoundFold) else None
        if not isinstance(state, RoundFold) or params is None:
            entry.take(site, result, self.aggregator_of(entry), self.rules)
            return
        try:
            self.rules.check_dxo_result(result, site, entry.number)  # every value finite before any is added
            dxo = acceptable_dxo(result, entry.number, state.kind)
            header = FLModel(params_type=_PARAMS_TYPES[state.kind], meta=dict(dxo.meta))
            result_fold = state.sums.open_result(header, site)
        except ResultRefused as e:
            log.warning("result refused: site=%s round=%d reason=%s", site, shown_round(entry.number), e)
            entry.fail(site, str(e))
            return
        kept = [params]  # for a rebuild, until the round's mean is made
        try:
            fold_tensors(result_fold, params)
            result_fold.refold = lambda again: fold_tensors(again, kept[0])
            result_fold.release = kept.clear
            dxo.data = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in params.items()}
            del params
            entry.take(site, result, state.view, self.rules)
            if site in entry.accepted:
                state.folded.append(site)
        except ResultRefused as e:
            result_fold.fail(str(e))
            entry.fail(site, str(e))
        except Exception as e:  # a bug in a check: the result fails, the round goes on
            log.exception("result failed: site=%s round=%d", site, shown_round(entry.number))
            result_fold.fail(bug_reason(e))
            entry.fail(site, bug_reason(e))
        finally:
            result_fold.fail(f"the result of {site} was not taken")  # nothing when it was committed

    # ----------------------------------------------------------------- the round's end

    def close(self, entry: RoundGathering, minimum: int, settings: str) -> None:
        """End the round's intake: no more results; a sum with part of a failed result is made again.

        Args:
            entry: The round, done waiting (`RoundGathering.wait_done`).
            minimum: Usable results it needs (``min_responses_required``).
            settings: The other settings that bound it, for the error (``learn_task_timeout=60 s``).

        Raises:
            WorkflowError: Fewer than ``minimum`` results are usable; the message names why each failed.
        """
        with self._rounds_lock:
            entry.closed = True
            self._closed_up_to = max(self._closed_up_to, entry.number)
        entry.pulls_stop.set()  # a result still coming is late: its pull ends now
        self._rebuild_if_tainted(entry, minimum)
        if len(entry.accepted) < minimum:
            failures = "; ".join(f"{site}: {why}" for site, why in entry.failed.items()) or "none"
            raise WorkflowError(
                f"{len(entry.accepted)} usable results of {len(entry.trainers)} "
                f"(min_responses_required={minimum}, {settings}); failed: {failures}"
            )

    def end(self, entry: RoundGathering) -> None:
        """Forget a round that is over (aggregated, failed or abandoned); its trainers may free their results."""
        self.release_round(entry)
        with self._rounds_lock:
            if self._rounds.get(entry.number) is entry:
                del self._rounds[entry.number]

    def abandon(self, current_round: int) -> list[str]:
        """Give up round ``current_round`` (its model never arrived whole): it may be made anew later.

        Returns:
            The trainers that had its model whole (see `RoundGathering.abandon`).
        """
        with self._rounds_lock:
            entry = self._rounds.pop(current_round, None)
        return entry.abandon() if entry is not None else []

    def _rebuild_if_tainted(self, entry: RoundGathering, minimum: int) -> None:
        """Close the round's sums; if a result failed after some of it was folded, make them again without it.

        The results the rebuild cannot pull again are dropped from ``entry.accepted`` (see
        `RoundGathering.drop`). A round with too few results is not rebuilt (it fails anyway).
        """
        state = entry.fold
        if not isinstance(state, RoundFold):
            return
        state.sums.close()
        tainted = state.sums.tainted()
        if not tainted or len(entry.accepted) < minimum:
            return
        left_out = state.sums.rebuild(self._stopping)
        # Not a site that died or was cut off: a result taken whole cannot be pulled again, so it
        # would be lost at every later rebuild (see `engine.workflows.round_folding`).
        self._whole_from.update(site for site in (*tainted, *left_out) if site in self._refused_sites)
        for site, why in left_out.items():
            entry.drop(site, why)
        log.warning(
            "round sum rebuilt: round=%d failed_midway=%s left_out=%s results=%d",
            entry.number + 1,
            sorted(tainted),
            sorted(left_out),
            len(entry.accepted),
        )

    def release_round(self, entry: RoundGathering) -> None:
        """Let the trainers free the results of a round whose mean is made (or that failed)."""
        state = entry.fold
        if isinstance(state, RoundFold):
            state.release()
            state.sums.reset_stats()

    def shutdown(self) -> None:
        """Stop pulling (the job ends) and let the trainers free the results of every round still open."""
        self._stopping.set()
        with self._rounds_lock:
            entries = list(self._rounds.values())
        for entry in entries:
            entry.pulls_stop.set()
        self._pulls.shutdown(wait=True, cancel_futures=True)
        with self._rounds_lock:
            entries, self._rounds = list(self._rounds.values()), {}
        for entry in entries:
            entry.release()
            self.release_round(entry)


def _twin_of(aggregator: Aggregator) -> FoldingModelAggregator | None:
    return aggregator.folding_twin() if isinstance(aggregator, DXOAggregator) else None


def _refold_from(
    codec: MessageCodec, frames: list[Any], sender: str, held: _Held, limits: dict[str, Any]
) -> Callable[[ResultFold], None]:
    """``refold(fold)``: pull the result in ``frames`` once more, into ``fold`` (its sender still serves it).

    The pull ends at once when ``fold`` fails (past the rebuild's time for it, or the job stopping).
    """

    def refold(fold: ResultFold) -> None:
        codec.decode(frames, sender=sender, fold=lambda _peeked: fold, held=held.entries, stop=fold.ended, **limits)

    return refold


def fold_tensors(fold: ResultFold, params: Mapping[str, torch.Tensor]) -> None:
    """Fold whole tensors into ``fold``: their layout first, then each tensor."""
    fold.check_layout({name: (tuple(t.shape), t.dtype) for name, t in params.items()})
    for name, tensor in params.items():
        fold.fold(name, tensor.detach())


def _streamed_items(data: Mapping[str, Any]) -> dict[str, str] | None:
    """Stream item -> param name when every value of a peeked DXO streams as a torch tensor, else None."""
    items = {value.item: name for name, value in data.items() if isinstance(value, StreamedItem) and value.is_tensor}
    return items if items and len(items) == len(data) else None


def _layout_of_base(entry: RoundGathering) -> dict[str, torch.Tensor] | None:
    """Names, shapes and dtypes of the round's model (meta tensors); None while it is not here, or not all tensors."""
    base = entry.base
    if base is None:
        return None
    try:
        data = DXO.from_shareable(base).data
    except ValueError:
        return None
    if not all(isinstance(value, torch.Tensor) for value in data.values()):
        return None
    return {name: torch.empty(value.shape, dtype=value.dtype, device="meta") for name, value in data.items()}


def _own_tensors(result: Shareable) -> dict[str, torch.Tensor] | None:
    """The CPU tensors of this client's own OK result, or None to take it whole."""
    if result.get_return_code() is not ReturnCode.OK:
        return None
    try:
        data = DXO.from_shareable(result).data
    except ValueError:
        return None
    if not data or not all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in data.values()):
        return None
    return dict(data)
