"""The weight difference a result carries, as the privacy filters see it: checked, in place, a block at a time.

A privacy filter changes a client's update where it lies (no second copy of the model): it
finds the params of the result's `FLModel` or DXO, checks them all before it changes any (a
refusal leaves the result as it was), and walks each tensor in flat blocks of at most
`BLOCK_ELEMENTS`, so the temporaries of a pass stay a few tens of MiB whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.model import DXO, FLMODEL_KEY, DataKind, FLModel, ParamsType, ReservedHeaderKey, Shareable

#: Elements of one block of a pass (16 MiB of float32): bounds the temporaries a pass makes.
BLOCK_ELEMENTS = 1 << 22

#: The highest round number a result's header may claim (a larger one is a hostile header).
MAX_ROUND = 10_000_000

#: Metric names the privacy filters add to a result's metrics (they reach the server's round metrics).
DP_EPSILON_METRIC = "dp_epsilon"


@dataclass
class Update:
    """The params of one result and where its metrics go.

    Attributes:
        tensors: Name -> float tensor sharing memory with the result's value (a numpy array is
            wrapped, not copied), in the result's order.
        model: The result's `FLModel`, when it carries one.
        dxo: The result's DXO, when it carries one instead.
        current_round: The round the result belongs to (0-based), when its header or model says.
    """

    tensors: dict[str, torch.Tensor]
    model: FLModel | None
    dxo: DXO | None
    current_round: int | None

    @property
    def numel(self) -> int:
        """How many values the update holds, over all tensors."""
        return sum(t.numel() for t in self.tensors.values())

    def add_metric(self, name: str, value: float) -> None:
        """Put ``name = value`` in the result's metrics (FLModel metrics, or the DXO's ``metrics`` meta)."""
        if self.model is not None:
            self.model.metrics = {**(self.model.metrics or {}), name: value}
        elif self.dxo is not None:
            metrics = self.dxo.meta.get("metrics")
            self.dxo.meta["metrics"] = {**(metrics if isinstance(metrics, dict) else {}), name: value}

    def add_meta(self, name: str, value: Any) -> None:
        """Put ``name = value`` in the result's meta."""
        target = self.model.meta if self.model is not None else self.dxo.meta if self.dxo is not None else None
        if target is not None:
            target[name] = value


def update_of(shareable: Shareable, filter_name: str) -> Update | None:
    """The weight difference ``shareable`` carries, checked; None when it carries no params.

    Raises:
        ValueError: The params are whole weights (FULL / WEIGHTS), or a value is not an
            in-memory floating-point tensor or writable array; the message names the fix.
    """
    model = shareable.get(FLMODEL_KEY)
    dxo = None
    if isinstance(model, FLModel):
        params = model.params
        is_diff = model.params_type is ParamsType.DIFF or model.params_type == ParamsType.DIFF.value
        kind = f"params_type {getattr(model.params_type, 'value', model.params_type)}"
    else:
        model = None
        try:
            dxo = DXO.from_shareable(shareable)
        except ValueError:
            return None  # a task or result without a model: nothing to protect
        if dxo.data_kind not in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF):
            return None
        params = dxo.data
        is_diff = dxo.data_kind is DataKind.WEIGHT_DIFF
        kind = f"a DXO of kind {dxo.data_kind.value}"
    if not params:
        return None
    if not is_diff:
        raise ValueError(
            f"{filter_name} protects a weight difference (DIFF) and got whole weights ({kind}): the "
            "update cannot be told from the weights the client was sent. Send the difference: the "
            "training script sends FLModel(params=trained - received, params_type=ParamsType.DIFF) "
            "(a DXO of kind WEIGHT_DIFF) and the workflow sets expected_params_type = DIFF"
        )
    tensors = {name: _tensor_of(name, value, filter_name) for name, value in params.items()}
    return Update(tensors, model, dxo, _round_of(shareable, model))


def blocks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of ``tensor`` that together cover it once: flat blocks of `BLOCK_ELEMENTS` (a
    non-contiguous tensor comes whole). Changing a view in place changes ``tensor``."""
    if not tensor.is_contiguous():
        yield tensor
        return
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), BLOCK_ELEMENTS):
        yield flat[start : start + BLOCK_ELEMENTS]


def _tensor_of(name: str, value: Any, filter_name: str) -> torch.Tensor:
    if callable(getattr(value, "resolve", None)):
        raise ValueError(
            f"{filter_name}: {name!r} is a lazy value on disk ({type(value).__name__}), not a tensor in memory: "
            "privacy filters belong in the client's task_result_filters (config_fed_client), where a "
            "result is still in memory; on the server the update was already seen"
        )
    if isinstance(value, np.ndarray):
        if not value.flags.writeable:
            raise ValueError(f"{filter_name}: {name!r} is a read-only numpy array; send a writable copy")
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{filter_name}: {name!r} is a {type(value).__name__}, expected a tensor or numpy array")
    if not value.is_floating_point():
        raise ValueError(
            f"{filter_name}: {name!r} holds {value.dtype} values, not floating-point weights; leave counters such "
            f"as num_batches_tracked out of the update (ExcludeVars before {filter_name} in task_result_filters)"
        )
    return value


def _round_of(shareable: Shareable, model: FLModel | None) -> int | None:
    """The result's round (0-based) from its header or model; None when absent or not a sane number."""
    for value in (shareable.get_header(ReservedHeaderKey.CURRENT_ROUND), model.current_round if model else None):
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ROUND:
            return value
    return None


def check_number(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a float in ``[low, high]`` (``(low, high]`` if ``low_open``); else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    if value != value or too_low or value > high:  # value != value: NaN
        left = "(" if low_open else "["
        raise ValueError(f"{name}: expected a number in {left}{low:g}, {high:g}], got {value!r}")
    return value
