"""`WeightedAggregationHelper`: a running weighted sum of contributions, one value at a time.

The helper keeps the sum only (one model's worth of memory), never the contributions. A value
with a callable ``resolve()`` attribute is a lazy reference to a tensor on disk: it is resolved
right before it is accumulated and the tensor is dropped right after, so at most one received
tensor is in memory at a time, whatever the number of clients.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from engine.errors import ResultRefused
from engine.fobs.tensor_pool import pooled_empty

logger = logging.getLogger(__name__)


def resolve_value(value: Any) -> Any:
    """Return ``value.resolve()`` when ``value`` is a lazy reference, else ``value`` itself."""
    resolve = getattr(value, "resolve", None)
    return resolve() if callable(resolve) else value


def release_values(data: Mapping[str, Any]) -> None:
    """Call ``release()`` on every value of ``data`` that has a callable ``release`` attribute.

    Lazy references of the disk download feature implement ``release()`` to drop their hold on
    the temp file they point into; plain tensors, arrays and numbers have none and are skipped.
    A failing ``release()`` is logged and does not stop the others.
    """
    for name, value in data.items():
        release = getattr(value, "release", None)
        if not callable(release):
            continue
        try:
            release()
        except Exception:  # the contribution is already summed; a leaked temp file must not undo that
            logger.warning("release() of a lazy value failed: name=%s", name, exc_info=True)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _sum_dtype_torch(dtype: torch.dtype) -> torch.dtype:
    # float64 keeps its precision; half precision sums in float32 so a few thousand additions do
    # not round away; integer counters (BatchNorm num_batches_tracked) sum exactly in float64.
    if dtype == torch.float64 or not dtype.is_floating_point:
        return torch.float64
    return torch.float32


def _sum_dtype_numpy(dtype: np.dtype) -> np.dtype:
    if dtype == np.float64 or not np.issubdtype(dtype, np.floating):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _kind_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, np.ndarray):
        return "ndarray"
    if _is_number(value):
        return "number"
    raise TypeError(f"cannot aggregate a value of type {type(value).__name__}")


def _check_lazy(value: Any, current: _Sum | None, contributor_name: str, name: str) -> None:
    """Check a lazy value by its ``verify()`` and ``shape`` where it has them."""
    verify = getattr(value, "verify", None)
    with _naming(contributor_name, name):
        shape = getattr(value, "shape", None)
        if current is not None and current.shape is not None and shape is not None:
            if tuple(shape) != current.shape:
                raise ValueError(f"shape {tuple(shape)} differs from the first contribution's {current.shape}")
        if callable(verify):
            try:
                verify()
            except Exception as e:
                raise ValueError(str(e)) from e


@contextmanager
def _naming(contributor_name: str, name: str) -> Iterator[None]:
    """A value that does not fit (a TypeError or ValueError inside) as `ResultRefused`, naming who sent which value."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise ResultRefused(f"{contributor_name}: value {name!r}: {e}") from e


def _weighted_copy(value: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight * value`` in the sum's dtype, in new memory (pooled for CPU tensors)."""
    dtype = _sum_dtype_torch(value.dtype)
    if value.device.type != "cpu":
        return value.to(dtype=dtype, copy=True).mul_(weight)
    total = pooled_empty(value.shape, dtype)
    if value.dtype == dtype:
        return torch.mul(value, weight, out=total)
    return total.copy_(value).mul_(weight)  # widen first, so the product is taken in the sum's dtype


class _Sum:
    """The running weighted sum of one named value and what is needed to turn it into a mean."""

    __slots__ = ("kind", "dtype", "shape", "total", "weight")

    def __init__(self, kind: str, dtype: Any, shape: tuple[int, ...] | None) -> None:
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.total: Any = None
        self.weight = 0.0

    def check(self, value: Any) -> None:
        """Raise TypeError or ValueError when ``value`` cannot be added to this sum."""
        kind = _kind_of(value)
        if kind != self.kind:
            raise ValueError(f"expected a {self.kind}, got a {kind}")
        if self.shape is not None and tuple(value.shape) != self.shape:
            raise ValueError(f"shape {tuple(value.shape)} differs from the first contribution's {self.shape}")

    def add(self, value: Any, weight: float) -> None:
        if self.kind == "tensor":
            value = value.detach()
            if self.total is None:
                self.total = _weighted_copy(value, weight)
            else:
                self.total.add_(value.to(self.total.device), alpha=weight)
        elif self.kind == "ndarray":
            if self.total is None:
                self.total = np.multiply(value, weight, dtype=_sum_dtype_numpy(value.dtype))
            else:
                self.total += np.multiply(value, weight, dtype=self.total.dtype)
        else:
            self.total = (0.0 if self.total is None else self.total) + float(value) * weight
        self.weight += weight

    def mean(self) -> Any:
        """The weighted mean in the first contribution's dtype; divides the sum in place."""
        if self.kind == "number":
            return self.total / self.weight
        if self.kind == "tensor":
            mean = self.total.div_(self.weight)
            if not self.dtype.is_floating_point:
                mean.round_()
            return mean.to(self.dtype)
        mean = np.divide(self.total, self.weight, out=self.total)
        if not np.issubdtype(self.dtype, np.floating):
            np.round(mean, out=mean)
        return mean.astype(self.dtype, copy=False)


def _new_sum(value: Any) -> _Sum:
    kind = _kind_of(value)
    if kind == "number":
        return _Sum(kind, float, None)
    return _Sum(kind, value.dtype, tuple(value.shape))


#: The running weighted sum of one named value (for aggregators that fold values themselves,
#: `engine.aggregators.folding`): ``new_running_sum(first)``, then ``check(v)`` / ``add(v, w)``, ``mean()``.
RunningSum = _Sum
new_running_sum = _new_sum


def zero_running_sum(shape: tuple[int, ...], dtype: torch.dtype) -> _Sum:
    """A tensor sum of ``shape`` for inputs of ``dtype`` that is all zeros (weight 0), to add pieces into."""
    current = empty_running_sum(shape, dtype)
    current.total.zero_()
    return current


def empty_running_sum(shape: tuple[int, ...], dtype: torch.dtype) -> _Sum:
    """`zero_running_sum` but not zeroed yet: its total holds whatever the memory held (zero it before use)."""
    current = _Sum("tensor", dtype, tuple(shape))
    current.total = pooled_empty(shape, _sum_dtype_torch(dtype))
    return current


class WeightedAggregationHelper:
    """Fold weighted contributions into a running sum and return their weighted mean.

    The same role as NVIDIA FLARE's helper of that name, lean in memory: only the sum is kept,
    and lazy values are resolved one at a time. Tensors and arrays sum in float32 (float16,
    bfloat16, float32 inputs) or float64 (float64 and integer inputs) and the mean comes back in
    the input's dtype, rounded for integers. Python numbers (metrics) sum as floats. Safe to call
    from several threads.

    Args:
        exclude_vars: Regex; names it matches (``re.search``) are skipped. None skips nothing.
        weigh_metrics: Whether numbers (metrics) are weighted like the tensors; when False each
            contribution counts once, a plain mean.

    Example:
        >>> helper = WeightedAggregationHelper()
        >>> helper.add({"w": torch.ones(2)}, weight=3.0, contributor_name="site-1", contribution_round=0)
        >>> helper.add({"w": torch.zeros(2)}, weight=1.0, contributor_name="site-2", contribution_round=0)
        >>> helper.get_result()["w"]
        tensor([0.7500, 0.7500])
    """

    def __init__(self, exclude_vars: str | None = None, weigh_metrics: bool = True) -> None:
        try:
            self._exclude = re.compile(exclude_vars) if exclude_vars else None
        except re.error as e:
            raise ValueError(f"exclude_vars: {exclude_vars!r} is not a valid regular expression: {e}") from e
        self._weigh_metrics = weigh_metrics
        self._lock = threading.Lock()
        self._sums: dict[str, _Sum] = {}
        self._history: list[dict[str, Any]] = []
        self._broken: str | None = None

    def add(self, data: Mapping[str, Any], weight: float, contributor_name: str, contribution_round: int) -> None:
        """Add ``weight`` times each value of ``data`` to the running sum.

        Every value that is not lazy is checked (type, shape) before anything is added, so a
        refused contribution leaves the sum as it was. A lazy value is checked once resolved: if
        it fails after other values of the same contribution were added, the sum is left
        half-updated and `get_result` raises until `reset_stats` is called.

        Args:
            data: Name -> torch tensor, numpy array, number, or lazy value with ``resolve()``.
            weight: The contribution's weight (>= 0), e.g. its number of local training steps.
            contributor_name: Who sent it, e.g. ``"site-1"``.
            contribution_round: The round it belongs to.

        Raises:
            ResultRefused: The contributor already contributed to this round, the weight is negative
                or not finite, a value's kind or shape differs from the sum's, or a value is
                neither a tensor, an array, a number nor a lazy value.
        """
        if not _is_number(weight) or not math.isfinite(weight) or weight < 0:
            raise ResultRefused(f"weight of {contributor_name}: expected a finite number >= 0, got {weight!r}")
        weight = float(weight)
        with self._lock:
            if any(
                h["contributor_name"] == contributor_name and h["round"] == contribution_round for h in self._history
            ):
                raise ResultRefused(
                    f"{contributor_name} already contributed to round {contribution_round}; "
                    "a second contribution is refused"
                )
            names = [name for name in data if self._exclude is None or not self._exclude.search(name)]
            self._check_known_values(data, names, contributor_name)
            for i, name in enumerate(names):
                try:
                    self._add_one(name, data[name], weight, contributor_name)
                except BaseException as e:
                    if i > 0:  # values before this one are in the sum already: it is no longer a sum of whole results
                        self._broken = f"adding {name!r} of {contributor_name} failed: {e!r}"
                    raise
            self._history.append({"contributor_name": contributor_name, "round": contribution_round, "weight": weight})
        logger.debug(
            "contribution added: contributor=%s round=%s weight=%s values=%d",
            contributor_name,
            contribution_round,
            weight,
            len(names),
        )

    def _check_known_values(self, data: Mapping[str, Any], names: list[str], contributor_name: str) -> None:
        for name in names:
            value = data[name]
            current = self._sums.get(name)
            if callable(getattr(value, "resolve", None)):
                # Resolving here would load it twice: check what it tells without loading, so a
                # damaged or misfit contribution is refused before any of it enters the sum.
                _check_lazy(value, current, contributor_name, name)
                continue
            with _naming(contributor_name, name):
                if current is None:
                    _kind_of(value)
                else:
                    current.check(value)

    def _add_one(self, name: str, value: Any, weight: float, contributor_name: str) -> None:
        value = resolve_value(value)
        current = self._sums.get(name)
        with _naming(contributor_name, name):
            if current is None:
                current = _new_sum(value)
            else:
                current.check(value)
        if current.kind == "number" and not self._weigh_metrics:
            weight = 1.0
        with torch.no_grad():
            current.add(value, weight)
        self._sums[name] = current
        del value  # the resolved tensor must not outlive its accumulation

    def get_result(self) -> dict[str, Any]:
        """Return name -> weighted mean, then reset the helper (as NVIDIA FLARE's does).

        The sums are divided in place and handed back, so no second model-sized buffer is made
        (except where the input dtype differs from the sum's, e.g. float16). Call `get_len` and
        `get_history` before this if they are needed.

        Raises:
            RuntimeError: Nothing was added, or an earlier `add` failed halfway.
            ValueError: The total weight of a value is 0 (every contribution had weight 0).
        """
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"the running sum is incomplete ({self._broken}); call reset_stats()")
            if not self._history:
                raise RuntimeError("nothing to aggregate: no contribution was added")
            zero = [name for name, s in self._sums.items() if s.weight == 0]
            if zero:
                raise ValueError(f"total weight is 0 for {len(zero)} value(s), e.g. {zero[0]!r}; no mean exists")
            result = {}
            while self._sums:  # pop as we go so each sum is freed once its mean exists
                name, current = next(iter(self._sums.items()))
                result[name] = current.mean()
                del self._sums[name]
            self._reset()
            return result

    def reset_stats(self) -> None:
        """Forget every contribution: sums, weights and history."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._sums = {}
        self._history = []
        self._broken = None

    def get_history(self) -> list[dict[str, Any]]:
        """One entry per contribution: ``{"contributor_name", "round", "weight"}``, in order."""
        with self._lock:
            return [dict(h) for h in self._history]

    def get_len(self) -> int:
        """How many contributions were added since the last reset."""
        with self._lock:
            return len(self._history)
