"""`NormClippingAggregator`: FedAvg of updates whose L2 norm is clipped to ``max_norm``."""

from __future__ import annotations

import logging
import math
import threading
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
from engine.aggregators.blocks import BLOCK_BYTES, block_elements, is_lazy, numel_of, read_block, torch_dtype_of
from engine.aggregators.stacked import (
    check_block_bytes,
    compile_exclude_vars,
    compute_dtype,
    returns_numpy,
    settled_params,
)
from engine.aggregators.weighted import WeightedAggregationHelper, release_values
from engine.errors import ResultRefused
from engine.fobs.tensor_pool import pooled_empty
from engine.model import FLModel, ParamsType

logger = logging.getLogger(__name__)


def _blocks(value: Any, dtype: torch.dtype, block_bytes: int) -> tuple[int, int, torch.Tensor | None]:
    """``(numel, step, buffer)`` to read ``value`` block by block (the buffer for a lazy value)."""
    total = numel_of(value)
    step = max(1, min(block_elements(dtype, block_bytes), total))
    buffer = torch.empty(step, dtype=torch_dtype_of(value)) if is_lazy(value) else None
    return total, step, buffer


class _RunningSum:
    """The weighted sum of one param's (clipped) values, flat, in the compute dtype."""

    __slots__ = ("dtype", "shape", "numpy", "total", "weight", "global_weight")

    def __init__(self, value: Any) -> None:
        self.dtype = torch_dtype_of(value)
        self.shape = tuple(int(size) for size in value.shape)
        self.numpy = returns_numpy(value)
        self.total = pooled_empty((numel_of(value),), compute_dtype(self.dtype)).zero_()
        self.weight = 0.0
        #: How much of the global model the sum still lacks: sum of ``weight * (1 - scale)`` of
        #: the clipped FULL results, added once at the end rather than read with every result.
        self.global_weight = 0.0

    def check(self, value: Any) -> None:
        shape, dtype = tuple(int(size) for size in value.shape), torch_dtype_of(value)
        if shape != self.shape or dtype != self.dtype:
            raise ValueError(
                f"shape {shape} and dtype {dtype} differ from the accepted results' {self.shape} and {self.dtype}"
            )

    def mean(self) -> Any:
        """The weighted mean in the values' dtype and shape; divides the sum in place."""
        mean = self.total.div_(self.weight)
        if not self.dtype.is_floating_point:
            mean.round_()
        mean = mean.to(self.dtype).reshape(self.shape)
        return mean.numpy() if self.numpy else mean


class NormClippingAggregator(ModelAggregator):
    """Weighted mean of the results' updates, each scaled down to an L2 norm of at most ``max_norm``.

    A result's update is its params for DIFF results, its params minus the global model for
    FULL ones (the global model comes from the ``load_global`` the workflow gives to
    `start_round`, read once per round when the first FULL result arrives). The update is
    scaled by ``min(1, max_norm / ||update||)``, the norm taken over all float tensors of the
    result; integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are averaged unclipped.
    The aggregate is the weighted mean (weights as FedAvg's: ``NUM_STEPS_CURRENT_ROUND`` times
    ``aggregation_weights``) of the clipped updates: a DIFF for DIFF results, the global model
    plus that mean for FULL ones. Metrics are averaged with the same weights. A result whose
    update has a NaN or an infinity is refused. The aggregate's meta lists the ``clipped``
    contributors.

    Results are folded in as they arrive (nothing is kept): one pass over a result (and the
    global model) for the norm, a second to add the scaled result to a running sum (a clipped
    FULL result is ``scale * x + (1 - scale) * global``: the global model's share of all of them
    is added once, when the round is aggregated).

    Defends against: any one site dominating the mean with a huge update (scaled or boosted
    model replacement): each site's pull on the aggregate is bounded by ``max_norm`` times its
    share of the weight (``max_norm / n`` with equal weights). Not against updates that stay
    within the norm, e.g. a sign-flipped honest update, nor against many colluding sites.

    Costs: memory, the running sum (one model in float32) plus, for FULL results, the global
    model for the round. Time: two passes over each result (a disk-downloaded result is read
    twice), about twice a weighted mean's.

    Args:
        max_norm: The largest L2 norm an update keeps (> 0), in the params' units.
        aggregation_weights: Client name -> extra weight factor (default 1.0 for each).
        weigh_by_local_iter: Whether to weight by ``NUM_STEPS_CURRENT_ROUND``.
        max_local_steps: The largest ``NUM_STEPS_CURRENT_ROUND`` a result may claim.
        exclude_vars: Regex of param names left out of the aggregate (and of the norm).
        block_bytes: Bytes of one block read from a result at a time.

    Example:
        In ``config_fed_server.conf``, with ``aggregator_id = robust`` in FedAvg's args::

            { id = robust, path = engine.aggregators.NormClippingAggregator, args { max_norm = 5.0 } }
    """

    def __init__(
        self,
        max_norm: float,
        aggregation_weights: dict[str, float] | None = None,
        weigh_by_local_iter: bool = True,
        max_local_steps: float = DEFAULT_MAX_LOCAL_STEPS,
        exclude_vars: str | None = None,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        if (
            not isinstance(max_norm, (int, float))
            or isinstance(max_norm, bool)
            or not math.isfinite(max_norm)
            or max_norm <= 0
        ):
            raise ValueError(f"max_norm: expected a finite number > 0, got {max_norm!r}")
        self._max_norm = float(max_norm)
        self._weights = check_aggregation_weights(aggregation_weights)
        self._weigh_by_local_iter = weigh_by_local_iter
        self._max_local_steps = check_max_local_steps(max_local_steps)
        self._exclude = compile_exclude_vars(exclude_vars)
        self._block_bytes = check_block_bytes(block_bytes)
        self._lock = threading.Lock()
        self._global_lock = threading.Lock()
        self._load_global: Callable[[], Mapping[str, Any]] | None = None
        self._global: dict[str, Any] | None = None
        self._reset()

    def start_round(self, current_round: int, load_global: Callable[[], Mapping[str, Any]]) -> None:
        """Remember how to read the round's global model (read when the first FULL result arrives)."""
        with self._global_lock:
            self._load_global = load_global
            self._global = None

    def accept_model(self, model: FLModel, contributor: str) -> None:
        """Clip ``model``'s update and add it to the running weighted sum.

        Raises:
            ResultRefused: The model has no params or a value that cannot be aggregated, its params
                type differs from the accepted ones', a param does not fit the sum or the global
                model, its update is not finite, its weight is invalid, or its contributor was
                already accepted.
            RuntimeError: A FULL result arrived but the workflow gave no global model (no
                `start_round`), or the sum broke earlier (see `aggregate_model`).
        """
        if model.params is None:
            raise ResultRefused(f"result of {contributor} carries no params; nothing to aggregate")
        params_type = ParamsType(model.params_type)
        weight = self._weights.get(contributor, 1.0)
        if self._weigh_by_local_iter:
            weight *= local_steps(model.meta, contributor, self._max_local_steps)
        metrics = numeric_metrics(model.metrics, contributor)
        params, _ = settled_params(model.params, self._exclude, contributor)
        self._reserve(contributor, params_type)
        try:
            base = self._global_params() if params_type is ParamsType.FULL else None
            norm = self._update_norm(params, base, contributor)
            scale = 1.0 if norm <= self._max_norm else self._max_norm / norm
            with self._lock:
                self._fold(params, base, weight, scale, contributor)
                if metrics:
                    self._metrics.add(metrics, weight, contributor, 0)
                if scale < 1.0:
                    self._clipped.append(contributor)
                self._accepted += 1
        except BaseException:
            with self._lock:
                self._contributors.discard(contributor)
                if not self._contributors:
                    self._params_type = None
            raise
        release_values(model.params)
        logger.debug(
            "result folded: contributor=%s weight=%s update_norm=%.6g scale=%.6g", contributor, weight, norm, scale
        )

    def _reserve(self, contributor: str, params_type: ParamsType) -> None:
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"the running sum is incomplete ({self._broken}); call reset_stats()")
            if contributor in self._contributors:
                raise ResultRefused(f"{contributor} already contributed to this round; a second result is refused")
            if self._params_type is not None and params_type is not self._params_type:
                raise ResultRefused(
                    f"result of {contributor} has {params_type.value} params but the accepted ones are "
                    f"{self._params_type.value}; all results of a round must be of one type"
                )
            self._contributors.add(contributor)
            self._params_type = params_type

    def _global_params(self) -> dict[str, Any]:
        with self._global_lock:
            if self._global is None:
                if self._load_global is None:
                    raise RuntimeError(
                        "NormClippingAggregator needs the global model to clip FULL results, but the workflow "
                        "gave none (it did not call start_round); send DIFF results or use a workflow that does"
                    )
                self._global = dict(self._load_global())
            return self._global

    def _update_norm(self, params: dict[str, Any], base: dict[str, Any] | None, contributor: str) -> float:
        """The L2 norm of the result's update over its float params (one pass over them)."""
        squares = 0.0
        for name, value in params.items():
            dtype = torch_dtype_of(value)
            if not dtype.is_floating_point:
                continue
            reference = _reference(base, name, value, contributor) if base is not None else None
            total, step, buffer = _blocks(value, dtype, self._block_bytes)
            reference_buffer = _blocks(reference, dtype, self._block_bytes)[2] if reference is not None else None
            work = torch.empty(step, dtype=compute_dtype(dtype))
            for start in range(0, total, step):
                count = min(step, total - start)
                block = read_block(value, start, count, buffer)
                if reference is None and block.dtype == work.dtype:
                    squares += float(torch.dot(block, block))
                    continue
                update = work[:count]
                if reference is None:
                    update.copy_(block)
                else:
                    other = read_block(reference, start, count, reference_buffer)
                    if block.dtype == other.dtype == update.dtype:
                        torch.sub(block, other, out=update)
                    else:  # widen first: a float16 difference would round before it is squared
                        update.copy_(block).sub_(other)
                squares += float(torch.dot(update, update))
        if not math.isfinite(squares):
            raise ResultRefused(f"result of {contributor}: its update has NaN or infinite values; refused")
        return math.sqrt(squares)

    def _fold(
        self, params: dict[str, Any], base: dict[str, Any] | None, weight: float, scale: float, contributor: str
    ) -> None:
        """Add ``weight`` times the clipped result to the sums (checked first: a misfit adds nothing)."""
        for name, value in params.items():
            current = self._sums.get(name)
            if current is not None:
                try:
                    current.check(value)
                except ValueError as e:
                    raise ResultRefused(f"result of {contributor}: param {name!r}: {e}") from e
        for i, name in enumerate(params):
            try:
                self._fold_one(name, params[name], base, weight, scale)
            except BaseException as e:
                if i > 0:  # names before this one are in the sums: they no longer sum whole results
                    self._broken = f"adding {name!r} of {contributor} failed: {e!r}"
                raise

    def _fold_one(self, name: str, value: Any, base: dict[str, Any] | None, weight: float, scale: float) -> None:
        current = self._sums.get(name) or _RunningSum(value)
        if not current.dtype.is_floating_point:
            _add_blocks(current.total, value, weight, self._block_bytes)  # counters are not clipped
        else:
            _add_blocks(current.total, value, weight * scale, self._block_bytes)
            if base is not None:  # scale * x + (1 - scale) * global: the global's share comes at the end
                current.global_weight += weight * (1.0 - scale)
        current.weight += weight
        self._sums[name] = current

    def aggregate_model(self) -> FLModel:
        """Return the weighted mean of the clipped updates as an `FLModel` and forget the round.

        Its meta is ``{"nr_aggregated": n, "clipped": [contributors whose update was scaled down]}``.

        Raises:
            RuntimeError: No result was accepted, or folding one failed halfway.
            ValueError: The total weight of a param is 0.
        """
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"the running sum is incomplete ({self._broken}); call reset_stats()")
            if not self._accepted:
                raise RuntimeError("nothing to aggregate: no result was accepted")
            zero = [name for name, current in self._sums.items() if current.weight == 0]
            if zero:
                raise ValueError(f"total weight is 0 for {len(zero)} param(s), e.g. {zero[0]!r}; no mean exists")
            count, params_type, clipped = self._accepted, self._params_type, sorted(self._clipped)
            params = {}
            while self._sums:  # pop as we go so each sum is freed once its mean exists
                name = next(iter(self._sums))
                current = self._sums.pop(name)
                if current.global_weight > 0:
                    _add_blocks(current.total, self._global_params()[name], current.global_weight, self._block_bytes)
                params[name] = current.mean()
            metrics = self._metrics.get_result() if self._metrics.get_len() else None
            self._reset()
        with self._global_lock:
            self._global = None
        logger.info(
            "models aggregated: aggregator=norm_clipping nr_aggregated=%d clipped=%d max_norm=%g",
            count,
            len(clipped),
            self._max_norm,
        )
        return FLModel(
            params=params, params_type=params_type, metrics=metrics, meta={"nr_aggregated": count, "clipped": clipped}
        )

    def reset_stats(self) -> None:
        """Forget every accepted result and the global model read for them."""
        with self._lock:
            self._reset()
        with self._global_lock:
            self._global = None

    def _reset(self) -> None:
        self._sums: dict[str, _RunningSum] = {}
        self._metrics = WeightedAggregationHelper()
        self._contributors: set[str] = set()
        self._clipped: list[str] = []
        self._accepted = 0
        self._params_type: ParamsType | None = None
        self._broken: str | None = None


def _add_blocks(total: torch.Tensor, value: Any, alpha: float, block_bytes: int) -> None:
    """``total += alpha * value``, ``total`` flat, ``value`` read a block at a time."""
    count, step, buffer = _blocks(value, torch_dtype_of(value), block_bytes)
    for start in range(0, count, step):
        size = min(step, count - start)
        total[start : start + size].add_(read_block(value, start, size, buffer), alpha=alpha)


def _reference(base: Mapping[str, Any], name: str, value: Any, contributor: str) -> Any:
    """The global model's ``name``, checked to have the result's shape."""
    if name not in base:
        raise ResultRefused(
            f"result of {contributor}: param {name!r} is not in the global model; a FULL result's update is "
            "taken against it"
        )
    reference = base[name]
    if tuple(int(size) for size in reference.shape) != tuple(int(size) for size in value.shape):
        raise ResultRefused(
            f"result of {contributor}: param {name!r} has shape {tuple(value.shape)}, the global model's is "
            f"{tuple(reference.shape)}"
        )
    return reference
