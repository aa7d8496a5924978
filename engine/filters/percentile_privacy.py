"""`PercentilePrivacy`: share only the largest updates, clipped (Shokri & Shmatikov, 2015)."""

from __future__ import annotations

import logging
import math

import torch

from engine.filters.filter import Filter
from engine.filters.selection import abs_percentile
from engine.filters.updates import blocks, check_number, update_of
from engine.model import Shareable

logger = logging.getLogger(__name__)


class PercentilePrivacy(Filter):
    """Keep the updates at or above a percentile of their absolute values, clip them, zero the rest.

    As NVIDIA FLARE's ``PercentilePrivacy`` ("Privacy-preserving deep learning", Shokri and
    Shmatikov, CCS 2015): the cutoff is the ``percentile`` of the absolute values of the whole
    update (every tensor together, numpy's linear interpolation, computed exactly a block at a
    time: see `abs_percentile`); an update value whose absolute value is below it becomes 0, the
    others are clipped to ``[-gamma, gamma]``. A 0-dimensional tensor is treated like any other.
    This shares less, but gives no formal guarantee: for one, use `GaussianPrivacy`.

    It works on a weight difference (an `FLModel` with ``params_type`` DIFF, or a DXO of kind
    WEIGHT_DIFF), in place; a result with whole weights is refused with the fix (send DIFF), one
    without params passes unchanged.

    Args:
        percentile: Which percentile of the absolute update values is the cutoff, in ``[0, 100]``.
            Default 10 (the smallest 10 % of the values are not shared).
        gamma: The largest absolute value shared, > 0. Default 0.01.

    Raises:
        ValueError: ``percentile`` outside ``[0, 100]`` or ``gamma`` not a finite number > 0.

    Example:
        In ``config_fed_client.conf`` (the training script sends a DIFF)::

            task_result_filters = [
              { tasks = [train], filters = [
                { path = engine.filters.PercentilePrivacy, args { percentile = 10, gamma = 0.01 } } ] }
            ]
    """

    def __init__(self, percentile: float = 10.0, gamma: float = 0.01) -> None:
        self.percentile = check_number("percentile", percentile, 0.0, 100.0)
        self.gamma = check_number("gamma", gamma, 0.0, math.inf, low_open=True)
        if math.isinf(self.gamma):
            raise ValueError(f"gamma: expected a finite number > 0, got {gamma!r}")

    def process(self, shareable: Shareable, site: str) -> Shareable:
        """Zero the small updates of the carried weight difference and clip the others, in place."""
        update = update_of(shareable, type(self).__name__)
        if update is None or update.numel == 0:
            return shareable
        try:
            cutoff = abs_percentile(update.tensors, self.percentile)
        except ValueError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from e
        for tensor in update.tensors.values():
            with torch.no_grad():
                threshold = _at_least(cutoff, tensor.dtype)
                for block in blocks(tensor):
                    below = (block < threshold) & (block > -threshold)  # |x| < threshold, without an abs copy
                    block.masked_fill_(below, 0)
                    block.clamp_(-self.gamma, self.gamma)
        logger.info(
            "percentile privacy site=%s round=%s percentile=%g cutoff=%.6g values=%d",
            site,
            update.current_round + 1 if update.current_round is not None else "?",
            self.percentile,
            cutoff,
            update.numel,
        )
        return shareable


def _at_least(value: float, dtype: torch.dtype) -> torch.Tensor:
    """The smallest number of ``dtype`` that is >= ``value``: ``x >= it`` iff ``x >= value`` for x of ``dtype``."""
    rounded = torch.tensor(value, dtype=dtype)
    if float(rounded) < value:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf, dtype=dtype))
    return rounded
