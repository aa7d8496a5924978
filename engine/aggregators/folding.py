"""`FoldingModelAggregator`: FedAvg's weighted mean, fed chunk by chunk while results arrive.

A result's weight (``NUM_STEPS_CURRENT_ROUND`` x its site's aggregation weight), params type and
names are in its message header, which the server reads before any tensor is pulled: the
workflow opens a `ResultFold` with them (refused there, before anything is pulled, when they do
not fit); the stream's layout (shapes, dtypes) is checked when it arrives, before the first
chunk; then each chunk's values are checked (finite) and added, weighted, into the running sum
as they land (`engine.streaming.folding.FoldingConsumer`). The result is *committed* (counted,
its metrics added) once it has arrived whole and passed the workflow's checks (`accept_model`).

A result that fails after some of its values were folded (its site died mid-upload, a chunk was
bad or holds a NaN, the round closed first) cannot be taken back out exactly: a float32 sum
does not give ``(s + w x) - w x == s`` (and with a large claimed weight the error is large), and
``x`` is gone. The aggregator records it instead (`tainted`) and refuses to make a mean from that
sum; `rebuild` then makes the sum again from nothing, out of the committed results alone: each
fold carries a `ResultFold.refold` that pulls its result once more (the server holds every folded
result's download open on its sender until the round's mean is made: `ResultFold.release`). So
the round's mean is the one without the failed result, as exact as any other. A result refused
before its first chunk leaves no trace and needs no rebuild.

Results that arrive whole (`accept_model` on a model with real values) are folded into the same
sums, so both kinds can meet in one round. The sums are `WeightedAggregationHelper`'s (float32,
or float64 for float64 and integer inputs), so the mean is bit for bit the one of
`WeightedModelAggregator` for the same order of results. Memory: the sums (one model), nothing
per result beyond the chunk being folded. Chunks of several results are added at the same time,
each holding only the stripes of the sum it touches (`engine.aggregators.striped_adds`).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine.aggregators.aggregator import (
    DEFAULT_MAX_LOCAL_STEPS,
    ModelAggregator,
    check_aggregation_weights,
    check_max_local_steps,
    local_steps,
    numeric_metrics,
)
from engine.aggregators.striped_adds import StripedAdds
from engine.aggregators.weighted import (
    RunningSum,
    WeightedAggregationHelper,
    empty_running_sum,
    new_running_sum,
    release_values,
    resolve_value,
    zero_running_sum,
)
from engine.errors import ResultRefused
from engine.model import FLModel, ParamsType

logger = logging.getLogger(__name__)

#: A rebuild gives every result this many times as long as its first pull took to come again...
REBUILD_SLOWDOWN = 3.0
#: ...and never less than this many seconds; one still pulling then is left out.
MIN_REBUILD_S = 30.0

#: ``check(params)``: the workflow's checks of a result's layout (name -> meta tensor); raises `ResultRefused`.
LayoutCheck = Callable[[dict[str, torch.Tensor]], None]
#: ``check(name, tensor)``: the workflow's checks of one complete tensor (finite values); raises `ResultRefused`.
TensorCheck = Callable[[str, torch.Tensor], None]


class ResultFold:
    """One result being folded into a `FoldingModelAggregator`'s sum (a `TensorSink` of the stream).

    Made by `FoldingModelAggregator.open_result`; the stream calls `check_layout` once, then
    `fold` per complete tensor; the workflow then passes the result to `accept_model`, or the
    server calls `fail`.
    """

    def __init__(
        self,
        owner: FoldingModelAggregator,
        contributor: str,
        weight: float,
        params_type: ParamsType,
        items: Mapping[str, str],
        check_layout: LayoutCheck | None,
        check_tensor: TensorCheck | None,
    ) -> None:
        self.owner = owner
        self.contributor = contributor
        self.weight = weight
        self.params_type = params_type
        self.items = dict(items)
        self._check_layout = check_layout
        self._check_tensor = check_tensor
        self.expected: set[str] = set()
        self.layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        #: Params whose every element is in the sum.
        self.folded: set[str] = set()
        #: Whether anything of this result is in the sum (a failure then taints it).
        self.touched = False
        self.failed: str | None = None
        #: Set when it fails: a pull still running into it (a rebuild's, past its time) may end at once.
        self.ended = threading.Event()
        #: Whether its tensors came one at a time from a stream (`check_layout` was called).
        self.streamed = False
        #: ``refold(fold)``: pulls this result once more into ``fold`` (set by who received it).
        self.refold: Callable[[ResultFold], None] | None = None
        #: ``release()``: its sender may free the result (set by who received it); called once.
        self.release: Callable[[], None] | None = None
        #: The accepted metrics it was committed with.
        self.metrics: dict[str, Any] | None = None
        self.round = 0
        #: Whether it is being folded again by `FoldingModelAggregator.rebuild`.
        self.rebuilding = False
        self.opened_at = time.monotonic()
        #: Seconds from its header to its commit the first time (what a rebuild allows it, times a factor).
        self.pull_seconds = 0.0

    def again(self) -> ResultFold:
        """A fresh fold of the same result (weight, checks, receiver's hooks), for `FoldingModelAggregator.rebuild`."""
        fold = ResultFold(
            self.owner,
            self.contributor,
            self.weight,
            self.params_type,
            self.items,
            self._check_layout,
            self._check_tensor,
        )
        fold.refold, fold.release, fold.metrics, fold.round = self.refold, self.release, self.metrics, self.round
        fold.rebuilding, fold.pull_seconds = True, self.pull_seconds
        return fold

    def let_go(self) -> None:
        """Let its sender free the result (once; errors are logged, never raised)."""
        release, self.release = self.release, None
        if release is not None:
            try:
                release()
            except Exception:
                logger.exception("could not release the result of %s", self.contributor)

    def name_of(self, item: str) -> str:
        """The param name a stream item stands for (the item itself when not mapped)."""
        return self.items.get(item, item)

    def check_layout(self, layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Refuse a layout unlike the model's (the workflow's check) or the sum's, before any chunk.

        Raises:
            ResultRefused: Names, shapes, dtypes or the params type do not fit; nothing was folded.
        """
        params = {
            self.name_of(item): torch.empty(shape, dtype=dtype, device="meta")
            for item, (shape, dtype) in layout.items()
        }
        if len(params) != len(layout):
            raise ResultRefused(f"result of {self.contributor}: two stream entries stand for one param")
        if self._check_layout is not None:
            self._check_layout(params)
        self.owner._check_fits(params, self)
        self.layout = {name: (tuple(value.shape), value.dtype) for name, value in params.items()}
        self.expected = set(params)
        self.streamed = True

    def fold_piece(self, item: str, start: int, values: torch.Tensor) -> None:
        """Check elements ``start ..`` of one param (flat) and add ``weight x values`` to the sum there.

        Raises:
            ResultRefused: The values are refused (the workflow's check: finite), or the round has
                closed; the download fails, and the sum is tainted if anything of it was folded.
        """
        name = self.name_of(item)
        if name not in self.expected:
            raise ResultRefused(f"result of {self.contributor}: {name!r} is not in the layout it announced")
        check = None if self._check_tensor is None else functools.partial(self._check_tensor, name)
        self.owner._fold_piece(self, name, start, values, check)

    def complete(self, item: str) -> None:
        """Every element of one param has been folded: it counts in the param's total weight."""
        self.owner._complete(self, self.name_of(item))

    def fold(self, item: str, tensor: torch.Tensor) -> None:
        """`fold_piece` of a whole tensor, then `complete`."""
        self.fold_piece(item, 0, tensor.reshape(-1))
        self.complete(item)

    def fail(self, reason: str) -> bool:
        """The result will not be committed (it failed or was refused); taints the sum if it folded anything.

        Returns:
            Whether it was failed now: False when it had been committed, failed or forgotten before.
        """
        failed = self.owner._fail(self, reason)
        if failed:
            self.ended.set()
        return failed


class FoldingModelAggregator(ModelAggregator):
    """Weighted mean of the accepted models, folded one tensor at a time (FedAvg's default).

    The same mean as `WeightedModelAggregator` (same args, same weights, same sums), and also a
    sum that results stream into tensor by tensor (`open_result`). Results are FULL or DIFF, all
    of one type per round; names may be left out by a DIFF.

    Args:
        aggregation_weights: Client name -> extra weight factor (default 1.0 each).
        weigh_by_local_iter: Whether to weight by ``NUM_STEPS_CURRENT_ROUND``.
        max_local_steps: The largest ``NUM_STEPS_CURRENT_ROUND`` a result may claim.

    Example:
        >>> aggregator = FoldingModelAggregator()
        >>> fold = aggregator.open_result(FLModel(meta={"NUM_STEPS_CURRENT_ROUND": 2}), "site-1")
        >>> fold.check_layout({"w": ((1,), torch.float32)})
        >>> fold.fold("w", torch.ones(1))
        >>> aggregator.accept_model(FLModel(params={"w": torch.empty(1, device="meta")}), "site-1")
        >>> aggregator.aggregate_model().params["w"]
        tensor([1.])
    """

    def __init__(
        self,
        aggregation_weights: dict[str, float] | None = None,
        weigh_by_local_iter: bool = True,
        max_local_steps: float = DEFAULT_MAX_LOCAL_STEPS,
    ) -> None:
        self._weights = check_aggregation_weights(aggregation_weights)
        self._weigh_by_local_iter = weigh_by_local_iter
        self._max_local_steps = check_max_local_steps(max_local_steps)
        self._lock = threading.Lock()
        self._adds = StripedAdds()  # chunks of several results are added at once
        self._sums: dict[str, RunningSum] = {}
        self._metrics = WeightedAggregationHelper()
        self._open: dict[str, ResultFold] = {}
        self._committed: dict[str, ResultFold] = {}
        self._tainted: dict[str, str] = {}
        self._params_type: ParamsType | None = None
        self._closed = False

    # -- folding ------------------------------------------------------------------------------------

    def open_result(
        self,
        header: FLModel,
        contributor: str,
        items: Mapping[str, str] | None = None,
        check_layout: LayoutCheck | None = None,
        check_tensor: TensorCheck | None = None,
    ) -> ResultFold:
        """Start folding ``contributor``'s result, known by its header (meta, params type; no tensors yet).

        Args:
            header: The result without its tensors: its meta give the weight.
            contributor: Who sends it.
            items: Stream item -> param name (the item is the name when absent).
            check_layout: The workflow's checks of the result's names, shapes and dtypes.
            check_tensor: The workflow's checks of each complete tensor.

        Raises:
            ResultRefused: Refused before anything is pulled: the weight is invalid, the site
                already sent a result this round, the params type differs from the round's, or
                the round has closed.
        """
        weight = self._weight_of(header, contributor)
        params_type = ParamsType(header.params_type) if header.params_type is not None else ParamsType.FULL
        with self._lock:
            if self._closed:
                raise ResultRefused(f"result of {contributor}: the round's aggregation has closed")
            if contributor in self._open or contributor in self._committed or contributor in self._tainted:
                raise ResultRefused(f"{contributor} already contributed to this round; a second result is refused")
            fold = ResultFold(self, contributor, weight, params_type, items or {}, check_layout, check_tensor)
            self._open[contributor] = fold
        return fold

    def _weight_of(self, model: FLModel, contributor: str) -> float:
        weight = self._weights.get(contributor, 1.0)
        if self._weigh_by_local_iter:
            weight *= local_steps(model.meta or {}, contributor, self._max_local_steps)
        return weight

    def _check_fits(self, params: Mapping[str, torch.Tensor], fold: ResultFold) -> None:
        """Refuse a result of another params type than the round's, or shapes unlike the sum's."""
        contributor = fold.contributor
        with self._lock:
            self._check_type(fold)
            for name, value in params.items():
                current = self._sums.get(name)
                if current is not None and current.shape != tuple(value.shape):
                    raise ResultRefused(
                        f"result of {contributor}: {name!r} has shape {tuple(value.shape)}, the round's sum "
                        f"{current.shape}"
                    )

    def _check_type(self, fold: ResultFold) -> None:
        others = [f for f in self._open.values() if f is not fold and f.expected]
        types = {f.params_type for f in others} | ({self._params_type} if self._params_type else set())
        if types and types != {fold.params_type}:
            raise ResultRefused(
                f"result of {fold.contributor} has {fold.params_type.value} params but the round's are "
                f"{next(iter(types)).value}; all results of a round must be of one type"
            )

    def _fold(self, fold: ResultFold, name: str, value: Any) -> None:
        with self._lock:
            if self._shut_for(fold):
                raise ResultRefused(f"result of {fold.contributor}: the round's aggregation has closed")
            if name in fold.folded:
                raise ResultRefused(f"result of {fold.contributor}: {name!r} arrived twice")
            current = self._sums.get(name)
            try:
                if current is None:
                    current = new_running_sum(value)
                else:
                    current.check(value)
            except (TypeError, ValueError) as e:
                raise ResultRefused(f"result of {fold.contributor}: value {name!r}: {e}") from e
            self._adds.drain()  # a whole value is added at once: no chunk may be landing in it
            if isinstance(current.total, torch.Tensor):  # chunks of other results may have made it
                self._adds.settle(name, current.total.view(-1))
            with torch.no_grad():
                current.add(value, fold.weight)
            self._sums[name] = current
            fold.folded.add(name)

    def _fold_piece(
        self, fold: ResultFold, name: str, start: int, values: torch.Tensor, check: Callable[[Any], None] | None
    ) -> None:
        with self._lock:
            if self._shut_for(fold):
                raise ResultRefused(f"result of {fold.contributor}: the round's aggregation has closed")
            if name in fold.folded:
                raise ResultRefused(f"result of {fold.contributor}: {name!r} arrived twice")
            numel = math.prod(fold.layout[name][0])
            if start < 0 or start + values.numel() > numel:  # before a sum is made: a refusal leaves none
                raise ResultRefused(f"result of {fold.contributor}: elements past the end of {name!r}")
            new = name not in self._sums
            current = self._sum_for(fold, name, zeroed=False)
            flat = current.total.view(-1)
            stripes = self._adds.begin(name, flat.numel(), blank=new)  # with the sum: its blank stripes are known

        def adding() -> None:  # a refusal before the first block leaves the sum as it was
            # Another thread may fail this result meanwhile (the round closing): `_fail` sets
            # `failed`, then reads `touched`; this sets `touched`, then reads `failed`. One of the
            # two sees the other's write, so a chunk either lands in a sum marked tainted or not at all.
            fold.touched = True
            if fold.failed is not None:
                raise ResultRefused(f"result of {fold.contributor}: the round's aggregation has closed")

        # Outside the lock: other results add meanwhile. Each block is checked just before it is added.
        self._adds.add(stripes, flat, start, values, fold.weight, check, adding)

    def _complete(self, fold: ResultFold, name: str) -> None:
        with self._lock:
            if self._shut_for(fold):
                raise ResultRefused(f"result of {fold.contributor}: the round's aggregation has closed")
            if name not in fold.expected or name in fold.folded:
                raise ResultRefused(f"result of {fold.contributor}: {name!r} completed twice or unannounced")
            self._sum_for(fold, name).weight += fold.weight
            fold.folded.add(name)

    def _shut_for(self, fold: ResultFold) -> bool:
        """Whether ``fold`` may no longer add to the sum (held under the lock)."""
        return self._open.get(fold.contributor) is not fold or (self._closed and not fold.rebuilding)

    def _sum_for(self, fold: ResultFold, name: str, zeroed: bool = True) -> RunningSum:
        """The running sum of ``name`` (held under the lock); a zero one of the announced layout if it has none yet.

        ``zeroed=False``: a new one is left blank (`StripedAdds` zeroes each stripe as adds reach it).
        """
        current = self._sums.get(name)
        shape, dtype = fold.layout[name]
        if current is None:
            current = self._sums[name] = (zero_running_sum if zeroed else empty_running_sum)(shape, dtype)
        elif current.kind != "tensor" or current.shape != shape:
            raise ResultRefused(f"result of {fold.contributor}: {name!r} does not fit the round's sum")
        return current

    def _fail(self, fold: ResultFold, reason: str) -> bool:
        """Fail ``fold`` if it is still open; whether it was (a committed one stays committed)."""
        with self._lock:
            if self._open.get(fold.contributor) is not fold:
                return False
            del self._open[fold.contributor]
            fold.failed = reason  # before `touched` is read: see `adding` in `_fold_piece`
            if fold.touched or fold.folded:
                self._tainted[fold.contributor] = reason
                logger.warning(
                    "partly folded result failed, round sum tainted: contributor=%s folded=%d reason=%s",
                    fold.contributor,
                    len(fold.folded),
                    reason,
                )
            return True

    def tainted(self) -> dict[str, str]:
        """Sites whose partly folded results are in the sum (site -> why they failed); empty when the sum is sound."""
        with self._lock:
            return dict(self._tainted)

    def close(self) -> None:
        """End the round's intake: results still open fail (tainting the sum if they folded anything)."""
        with self._lock:
            self._closed = True
            still_open = list(self._open.values())
        for fold in still_open:
            self._fail(fold, "the round closed before the result had arrived")

    # -- the ModelAggregator interface --------------------------------------------------------------

    def accept_model(self, model: FLModel, contributor: str) -> None:
        """Commit ``contributor``'s folded result, or fold a whole one now.

        Raises:
            ResultRefused: The model cannot be added (see `open_result`); a folded result that is
                incomplete taints the sum.
        """
        if model.params is None:
            raise ResultRefused(f"result of {contributor} carries no params; nothing to aggregate")
        with self._lock:
            fold = self._open.get(contributor)
        if fold is None:  # arrived whole: fold it here, value by value
            fold = self.open_result(model, contributor)
            try:
                with self._lock:
                    self._check_type(fold)
                fold.expected = set(model.params)
                self._check_whole(model.params, contributor)
                for name, value in model.params.items():
                    self._fold(fold, name, resolve_value(value))
            except BaseException as e:
                fold.fail(f"{type(e).__name__}: {e}")
                raise
            release_values(model.params)
        fold.metrics = numeric_metrics(model.metrics, contributor) or None
        fold.round = model.current_round or 0
        if self._commit(fold, set(model.params)):
            logger.info(
                "result folded: contributor=%s weight=%s tensors=%d streamed=%s",
                contributor,
                fold.weight,
                len(fold.folded),
                fold.streamed,
            )
            return
        reason = f"result of {contributor} arrived incomplete or after the round closed"
        with self._lock:
            fold = self._open.get(contributor)
        if fold is not None:
            fold.fail(reason)
        raise ResultRefused(reason)

    def _commit(self, fold: ResultFold, names: set[str]) -> bool:
        """Count ``fold`` in the mean if it is open and every one of ``names`` is folded; False otherwise."""
        with self._lock:
            if self._open.get(fold.contributor) is not fold or not fold.folded == fold.expected == names:
                return False
            del self._open[fold.contributor]
            if not fold.rebuilding:
                fold.pull_seconds = time.monotonic() - fold.opened_at
            self._committed[fold.contributor] = fold
            self._params_type = fold.params_type
            if fold.metrics:
                self._metrics.add(fold.metrics, fold.weight, fold.contributor, fold.round)
            return True

    def rebuild(self, stop: threading.Event | None = None) -> dict[str, str]:
        """Make a tainted sum again from the committed results alone, pulling each once more.

        Call it after `close`, when `tainted` is not empty: every committed result is folded
        anew, all at once, into zeroed sums through its `ResultFold.refold`; one that has none
        (it arrived whole, its values are gone), whose pull fails, or that is not in again within
        `REBUILD_SLOWDOWN` times its first pull (at least `MIN_REBUILD_S`) is left out. A failure
        while rebuilding taints the new sum, which is rebuilt again without it.

        Args:
            stop: Set when the job is stopping: the results still being pulled are left out.

        Returns:
            The results left out (site -> why); `tainted` is empty afterwards.
        """
        left_out: dict[str, str] = {}
        while True:
            with self._lock:
                if not self._tainted:
                    return left_out
                logger.warning(
                    "rebuilding the round's sum without partly folded results: failed=%s results=%d",
                    sorted(self._tainted),
                    len(self._committed),
                )
                committed = list(self._committed.values())
                self._adds.drain()
                self._adds.reset()
                self._sums, self._committed, self._tainted, self._open = {}, {}, {}, {}
                self._metrics.reset_stats()
                self._params_type = None
                stopping = stop is not None and stop.is_set()
                folds = [] if stopping else [old.again() for old in committed if old.refold is not None]
                self._open = {fold.contributor: fold for fold in folds}
            if stopping:  # no mean will be made: nothing is pulled again
                for old in committed:
                    left_out.setdefault(old.contributor, "the job is stopping")
                    old.let_go()
                return left_out
            for old in committed:
                if old.refold is None:
                    left_out[old.contributor] = "its result arrived whole and could not be folded again"
                    old.let_go()
            failures = self._fold_again(folds, stop)
            for fold in folds:
                if fold.contributor in failures:
                    left_out[fold.contributor] = failures[fold.contributor]
                    fold.let_go()

    def _fold_again(self, folds: list[ResultFold], stop: threading.Event | None) -> dict[str, str]:
        """Pull every fold's result once more, each on a thread of its own; return the ones that failed.

        One still pulling when its time is up (or ``stop`` is set) is failed: what it adds from
        then on is refused, and what it added taints the sum (rebuilt again without it).
        """
        failures: dict[str, str] = {}

        def run(fold: ResultFold) -> None:
            assert fold.refold is not None
            try:
                fold.refold(fold)
                if not self._commit(fold, set(fold.expected)):
                    raise ResultRefused("it arrived incomplete")
            except Exception as e:  # noqa: BLE001 - that result is left out; the others go on
                reason = f"its result could not be pulled again after another one failed midway: {e}"
                fold.fail(reason)
                failures[fold.contributor] = reason

        threads = {
            fold.contributor: threading.Thread(target=run, args=(fold,), name=f"refold-{fold.contributor}", daemon=True)
            for fold in folds
        }
        started = time.monotonic()
        for thread in threads.values():
            thread.start()
        for fold in folds:
            limit_s = max(MIN_REBUILD_S, REBUILD_SLOWDOWN * fold.pull_seconds)
            thread = threads[fold.contributor]
            while thread.is_alive() and time.monotonic() - started < limit_s and not (stop and stop.is_set()):
                thread.join(0.1)
            if thread.is_alive():
                why = "the job is stopping" if stop and stop.is_set() else f"not in again within {limit_s:.3g} s"
                reason = f"its result could not be pulled again after another one failed midway: {why}"
                if fold.fail(reason):  # not if it was committed meanwhile: then it is in the mean
                    failures.setdefault(fold.contributor, reason)
        return failures

    def _check_whole(self, params: Mapping[str, Any], contributor: str) -> None:
        """Refuse a whole result whose values do not fit the sum, before any of them is folded."""
        with self._lock:
            for name, value in params.items():
                if callable(getattr(value, "resolve", None)):
                    continue  # a lazy value: checked when resolved
                current = self._sums.get(name)
                try:
                    if current is None:
                        new_running_sum(value)  # its kind is one the sum takes
                    else:
                        current.check(value)
                except (TypeError, ValueError) as e:
                    raise ResultRefused(f"{contributor}: value {name!r}: {e}") from e

    def aggregate_model(self) -> FLModel:
        """The weighted mean of the committed results; forgets them.

        Raises:
            RuntimeError: Nothing was committed, or the sum is tainted by a partly folded result
                (`rebuild` it first).
        """
        with self._lock:
            self._adds.drain()  # a failed result's last chunk may still be landing
            if self._tainted:
                raise RuntimeError(
                    f"the round's sum holds parts of failed results ({sorted(self._tainted)}); rebuild it first"
                )
            if not self._committed:
                raise RuntimeError("nothing to aggregate: no contribution was added")
            counted = set().union(*(fold.folded for fold in self._committed.values()))
            for name in [name for name in self._sums if name not in counted]:
                del self._sums[name]  # begun by a result refused before it added anything: no mean of it
            zero = [name for name, s in self._sums.items() if s.weight == 0]
            if zero:
                raise ValueError(f"total weight is 0 for {len(zero)} value(s), e.g. {zero[0]!r}; no mean exists")
            count, params_type = len(self._committed), self._params_type
            for name, current in self._sums.items():
                if isinstance(current.total, torch.Tensor):
                    self._adds.settle(name, current.total.view(-1))
            params = {}
            while self._sums:  # pop as we go so each sum is freed once its mean exists
                name, current = next(iter(self._sums.items()))
                params[name] = current.mean()
                del self._sums[name]
            metrics = self._metrics.get_result() if self._metrics.get_len() else None
            held = self._reset()
        for fold in held:
            fold.let_go()
        logger.info("models aggregated: nr_aggregated=%d params_type=%s", count, params_type.value)
        return FLModel(params=params, params_type=params_type, metrics=metrics, meta={"nr_aggregated": count})

    def reset_stats(self) -> None:
        """Forget everything: sums, open and committed results (their senders may free them), taint."""
        with self._lock:
            held = self._reset()
        for fold in held:
            fold.let_go()

    def _reset(self) -> list[ResultFold]:
        """Forget everything (held under the lock); return the folds whose senders may now free them."""
        held = [*self._committed.values(), *self._open.values()]
        self._adds.drain()
        self._adds.reset()
        self._sums = {}
        self._metrics.reset_stats()
        self._open = {}
        self._committed = {}
        self._tainted = {}
        self._params_type = None
        self._closed = False
        return held
