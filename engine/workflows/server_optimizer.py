"""`ServerOptimizer`: the server optimizers of Reddi et al. 2021, "Adaptive Federated Optimization".

The clients' mean update is a pseudo-gradient ``d`` (the mean model minus the global model, or
the mean DIFF itself), and the server takes one optimizer step with it, element by element:

==========  ==================================================  ===========================
optimizer   state update                                        global model
==========  ==================================================  ===========================
sgd         (none)                                              ``x += lr * d``
momentum    ``m = momentum * m + d``                            ``x += lr * m`` (FedAvgM)
adam        ``m = b1 m + (1 - b1) d``; ``v = b2 v + (1 - b2) d²``  ``x += lr * m / (sqrt(v) + eps)``
yogi        ``m`` as adam; ``v -= (1 - b2) d² sign(v - d²)``        as adam
adagrad     ``m`` as adam; ``v += d²``                               as adam
==========  ==================================================  ===========================

As in the paper's Algorithm 2 (and Flower's FedAdam / FedYogi / FedAdagrad), there is no bias
correction, and ``m`` and ``v`` start at 0 (the paper allows any ``v`` >= eps², a difference of at
most eps² = 1e-6 by default). `apply` goes over one block of one tensor at a time: the new global
tensor is written over the mean tensor, the old global tensor is read a block at a time (from
the persistor's checkpoint), and the state comes from an `OptimizerState`, so nothing beyond the
mean and the state is model-sized. Tensors that are not floating point (BatchNorm's counters)
take the plain mean (FULL) or the old value plus the mean difference (DIFF).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.aggregators.blocks import BLOCK_BYTES, block_elements, read_block, torch_dtype_of
from engine.aggregators.weighted import resolve_value
from engine.model import ParamsType
from engine.workflows.optimizer_state import OptimizerState

#: The optimizers by name, and the state slots each keeps.
OPTIMIZER_SLOTS: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "momentum": ("m",),
    "adam": ("m", "v"),
    "yogi": ("m", "v"),
    "adagrad": ("m", "v"),
}

#: ``server_lr`` when the config gives none: FedAvg's step for sgd/momentum, the paper's usual
#: order of magnitude for the adaptive ones (whose steps are about ``lr`` per element).
DEFAULT_SERVER_LR = {"sgd": 1.0, "momentum": 1.0, "adam": 0.01, "yogi": 0.01, "adagrad": 0.01}


@dataclass(frozen=True)
class ServerOptimizer:
    """One server optimizer with its hyperparameters (checked by `from_args`).

    Attributes:
        name: ``sgd``, ``momentum``, ``adam``, ``yogi`` or ``adagrad``.
        lr: The server learning rate (``eta`` in the paper).
        momentum: ``momentum``'s decay of ``m``.
        beta1: The adaptive optimizers' decay of ``m``.
        beta2: adam's and yogi's decay of ``v``.
        epsilon: The adaptive optimizers' ``tau`` (added to ``sqrt(v)``).
    """

    name: str = "adam"
    lr: float = 0.01
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    epsilon: float = 1e-3

    @classmethod
    def from_args(
        cls,
        server_optimizer: str = "adam",
        server_lr: float | None = None,
        momentum: float = 0.9,
        beta1: float = 0.9,
        beta2: float = 0.99,
        epsilon: float = 1e-3,
    ) -> ServerOptimizer:
        """The optimizer a workflow's args name, checked.

        Raises:
            ValueError: An arg is out of its range; the message names it and the range.
        """
        if server_optimizer not in OPTIMIZER_SLOTS:
            names = ", ".join(OPTIMIZER_SLOTS)
            raise ValueError(f"server_optimizer: expected one of {names}, got {server_optimizer!r}")
        lr = DEFAULT_SERVER_LR[server_optimizer] if server_lr is None else server_lr
        if not _finite(lr) or lr <= 0:
            raise ValueError(f"server_lr: expected a finite number > 0, got {server_lr!r}")
        for arg, value in (("momentum", momentum), ("beta1", beta1), ("beta2", beta2)):
            if not _finite(value) or not 0 <= value < 1:
                raise ValueError(f"{arg}: expected a number in [0, 1), got {value!r}")
        if not _finite(epsilon) or epsilon <= 0:
            raise ValueError(f"epsilon: expected a finite number > 0, got {epsilon!r}")
        return cls(server_optimizer, float(lr), float(momentum), float(beta1), float(beta2), float(epsilon))

    @property
    def slots(self) -> tuple[str, ...]:
        """The state this optimizer keeps per param (``m``, ``v``)."""
        return OPTIMIZER_SLOTS[self.name]

    def apply(
        self,
        mean: dict[str, Any],
        params_type: ParamsType,
        global_params: Mapping[str, Any],
        state: OptimizerState,
        block_bytes: int = BLOCK_BYTES,
    ) -> dict[str, Any]:
        """The new global model from the round's ``mean`` (FULL or DIFF) and the old ``global_params``.

        Each float tensor of ``mean`` is overwritten with the new global tensor (no copy, except
        where a DIFF's dtype differs from the model's); names ``mean`` lacks keep their global
        value (read whole). The result has the global model's names in its order.

        Raises:
            ValueError: A name of ``mean`` is not in the global model, or its shape differs.
        """
        updated: dict[str, Any] = {}
        for name, value in mean.items():
            if name not in global_params:
                raise ValueError(f"the aggregate has {name!r}, which the global model does not")
            updated[name] = self._apply_one(name, value, params_type, global_params[name], state, block_bytes)
        return {
            name: updated[name] if name in updated else resolve_value(value) for name, value in global_params.items()
        }

    def _apply_one(
        self, name: str, value: Any, params_type: ParamsType, old: Any, state: OptimizerState, block_bytes: int
    ) -> Any:
        target, tensor = _writable(value, torch_dtype_of(old))
        if tuple(tensor.shape) != tuple(int(size) for size in old.shape):
            raise ValueError(f"{name!r}: the aggregate's shape {tuple(tensor.shape)} is not the global model's")
        flat, dtype = tensor.view(-1), torch_dtype_of(old)
        if not dtype.is_floating_point:  # counters: the plain mean, or the old value plus the mean difference
            if params_type is ParamsType.DIFF:
                flat.add_(resolve_value(old).reshape(-1).to(flat.dtype))
            return target
        work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        total = flat.numel()
        step = max(1, min(block_elements(work_dtype, block_bytes), total))
        buffers = [torch.empty(step, dtype=work_dtype) for _ in range(3)]
        old_buffer = torch.empty(step, dtype=dtype) if not isinstance(old, (torch.Tensor, np.ndarray)) else None
        for start in range(0, total, step):
            count = min(step, total - start)
            x = read_block(old, start, count, old_buffer)
            d, w, t = (buffer[:count] for buffer in buffers)
            d.copy_(flat[start : start + count])
            if params_type is ParamsType.FULL:
                d.sub_(x)  # the pseudo-gradient: mean - global
            blocks = {slot: state.block(slot, name, total, work_dtype, start, count) for slot in self.slots}
            self._step(d, w, t, blocks)  # d := the step taken
            for slot, block in blocks.items():
                state.commit(slot, name, start, block)
            flat[start : start + count].copy_(d.mul_(self.lr).add_(x))
        return target

    def _step(self, d: torch.Tensor, w: torch.Tensor, t: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Update the state blocks from the pseudo-gradient ``d``; leave the step in ``d`` (``w``, ``t``: scratch)."""
        if self.name == "sgd":
            return
        m = state["m"]
        if self.name == "momentum":
            m.mul_(self.momentum).add_(d)
            d.copy_(m)
            return
        m.mul_(self.beta1).add_(d, alpha=1 - self.beta1)
        v = state["v"]
        if self.name == "adam":
            v.mul_(self.beta2).addcmul_(d, d, value=1 - self.beta2)
        elif self.name == "yogi":
            torch.mul(d, d, out=w)
            torch.sub(v, w, out=t).sign_()
            v.sub_(t.mul_(w), alpha=1 - self.beta2)
        else:  # adagrad
            v.addcmul_(d, d)
        torch.sqrt(v, out=w).add_(self.epsilon)
        torch.div(m, w, out=d)


def _writable(value: Any, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    """``(what goes into the new model, a contiguous tensor of ``dtype`` sharing its memory)`` for a mean value.

    A tensor or array of the model's dtype is written in place; another dtype gets new memory of
    the model's dtype holding its values.
    """
    tensor = torch.from_numpy(value) if isinstance(value, np.ndarray) else torch.as_tensor(value)
    read_only = isinstance(value, np.ndarray) and not value.flags.writeable
    if tensor.dtype != dtype or not tensor.is_contiguous() or read_only:
        tensor = tensor.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        return tensor, tensor
    return value, tensor


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
