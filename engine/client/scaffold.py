"""`ScaffoldClient`: the client side of SCAFFOLD (Karimireddy et al., 2020), for a training script.

SCAFFOLD corrects each local step for the drift between a client's data and everyone's: the
server sends its control variate ``c`` with the model (in ``meta["scaffold_c_global"]``), each
client keeps its own ``c_i``, and after every optimizer step the script moves the weights by
``-lr * (c - c_i)``. At the end of the round the client updates ``c_i`` (the paper's option II)::

    c_i+ = c_i - c + (x - y) / (K * lr)      # x: the weights received, y: the weights trained

and sends ``c_i+ - c_i`` with its result (``meta["scaffold_c_delta"]``), which the server's
`engine.workflows.Scaffold` averages into ``c``. With a learning rate that changes between
steps, ``K * lr`` is the sum of the rates the steps used.

Example:
    >>> scaffold = flare.ScaffoldClient(net)
    >>> received = flare.receive()
    >>> net.load_state_dict(received.params)
    >>> scaffold.begin_round(received)
    >>> for x, y in batches:
    ...     optimizer.zero_grad(); loss_fn(net(x), y).backward(); optimizer.step()
    ...     scaffold.correct(lr)
    >>> flare.send(FLModel(params=net.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": k, **scaffold.end_round()}))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from engine.client.backends import installed_backend
from engine.client.state import ClientState
from engine.model import FLModel
from engine.model.scaffold_keys import C_DELTA_KEY, C_GLOBAL_KEY

#: The name of a site's control variate in its saved state (`engine.client.state`).
C_LOCAL_STATE = "scaffold_c_local"


class ScaffoldClient:
    """One site's control variate and the correction of its local steps.

    Args:
        model: The module the script trains; its trainable floating-point parameters get
            control variates (zero at first, as in the paper).
        state: Where ``c_i`` is kept between rounds: by default the site's saved state
            (``flare.client_state()``) when the script runs in a job, so that a script whose
            loop runs afresh for each task (a virtual client of ``flengine run -t``) or whose
            process was started again keeps its ``c_i``; None outside a job (memory only).
    """

    def __init__(self, model: torch.nn.Module, state: ClientState | None = None) -> None:
        self.model = model
        self._params = {
            name: param
            for name, param in model.named_parameters()
            if param.requires_grad and param.dtype.is_floating_point
        }
        self._state = state if state is not None else _site_state()
        saved = self._state.load_tensors(C_LOCAL_STATE) if self._state is not None else None
        if saved is not None:
            self.c_local = _control_variate(saved, self._params, what=f"{C_LOCAL_STATE} of the site's saved state")
            if self.c_local.keys() != self._params.keys():
                raise ValueError(f"{C_LOCAL_STATE}: the saved control variate does not cover every trainable parameter")
        else:
            self.c_local = {name: torch.zeros_like(param, requires_grad=False) for name, param in self._params.items()}
        self._start: dict[str, torch.Tensor] | None = None
        self._correction: dict[str, torch.Tensor] = {}
        self._lr_sum = 0.0

    def begin_round(self, received: FLModel) -> None:
        """Call once the received weights are loaded into the module, before the first step.

        Raises:
            ValueError: The server's control variate names a parameter the module lacks or has
                another shape for, or holds a value that is not finite; the message names it.
        """
        c_global = _control_variate(received.meta.get(C_GLOBAL_KEY), self._params)
        with torch.no_grad():
            self._start = {name: param.detach().clone() for name, param in self._params.items()}
            self._correction = {
                name: c_global.get(name, torch.zeros_like(self.c_local[name])) - self.c_local[name]
                for name in self._params
            }
        self._lr_sum = 0.0

    def correct(self, lr: float) -> None:
        """Call after each ``optimizer.step()``: moves each weight by ``-lr * (c - c_i)``.

        Args:
            lr: The learning rate of the step just taken (> 0).
        """
        if self._start is None:
            raise RuntimeError("ScaffoldClient.correct: call begin_round(received) first")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"ScaffoldClient.correct: lr must be a finite number > 0, got {lr!r}")
        with torch.no_grad():
            for name, param in self._params.items():
                param.add_(self._correction[name].to(param.device), alpha=-lr)
        self._lr_sum += lr

    def end_round(self) -> dict[str, Any]:
        """Update this site's control variate; return the meta to send with the result.

        Returns:
            ``{"scaffold_c_delta": {name: c_i+ - c_i}}``; empty deltas (zeros) when no step was
            taken this round, so a site that could not train leaves ``c`` as it is.
        """
        if self._start is None:
            raise RuntimeError("ScaffoldClient.end_round: call begin_round(received) first")
        delta: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, param in self._params.items():
                if self._lr_sum > 0:
                    # c_i+ - c_i = -c + (x - y) / (K lr) = -(correction + c_i) + (x - y) / (K lr)
                    change = (self._start[name] - param.detach()) / self._lr_sum - (
                        self._correction[name] + self.c_local[name]
                    )
                else:
                    change = torch.zeros_like(self.c_local[name])
                self.c_local[name] += change
                delta[name] = change.detach().clone()
        self._start = None
        if self._state is not None:
            self._state.save_tensors(C_LOCAL_STATE, self.c_local)
        return {C_DELTA_KEY: delta}


def _site_state() -> ClientState | None:
    """The site's saved state when the script runs in a job, else None."""
    backend = installed_backend()
    folder = getattr(backend, "state_dir", None)
    return ClientState(folder) if folder is not None else None


def _control_variate(
    value: Any, params: Mapping[str, torch.Tensor], what: str = C_GLOBAL_KEY
) -> dict[str, torch.Tensor]:
    """A control variate (the server's, or the site's saved one) checked against the module (None: zeros)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what}: expected a dict of tensors, got {type(value).__name__}")
    checked = {}
    for name, tensor in value.items():
        param = params.get(name)
        if param is None:
            raise ValueError(f"{what}: {name!r} is not a trainable parameter of the model")
        tensor = torch.as_tensor(tensor)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{what}: {name!r} has shape {tuple(tensor.shape)}, the parameter {tuple(param.shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what}: {name!r} holds a value that is not finite")
        checked[name] = tensor.detach().to(device=param.device, dtype=param.dtype)
    return checked
