"""`FedOpt`: FedAvg whose server applies the clients' mean update with an optimizer (FedAdam, FedYogi, ...)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.aggregators.blocks import BLOCK_BYTES, block_elements
from engine.model import FLModel, ParamsType, shown_round
from engine.workflows.fedavg import FedAvg
from engine.workflows.optimizer_state import FileState, MemoryState, OptimizerState
from engine.workflows.server_optimizer import ServerOptimizer

log = logging.getLogger(__name__)


class FedOpt(FedAvg):
    """FedAvg, except that the new global model is one server optimizer step from the old one
    along the clients' weighted mean update (Reddi et al. 2021, "Adaptive Federated Optimization").

    Takes every `FedAvg` arg by keyword (``**fedavg_args``, passed on whole: `flengine validate`
    checks them against FedAvg's signature, see `engine.config.signature`), plus:

    Args:
        server_optimizer: ``sgd`` (``server_lr = 1``: FedAvg), ``momentum`` (FedAvgM),
            ``adam``, ``yogi`` or ``adagrad`` (the formulas: `engine.workflows.server_optimizer`).
        server_lr: The server learning rate, > 0; None: 1.0 for sgd and momentum, 0.01 for the
            adaptive ones (whose step is about ``server_lr`` per weight, whatever the update's size).
        momentum: ``momentum``'s decay of its running update, in [0, 1).
        beta1: The adaptive optimizers' decay of the mean update ``m``, in [0, 1).
        beta2: adam's and yogi's decay of the squared update ``v``, in [0, 1).
        epsilon: The adaptive optimizers' ``tau`` (added to ``sqrt(v)``), > 0.

    The pseudo-gradient is the mean model minus the global model (``expected_params_type =
    FULL``) or the mean difference (``DIFF``). It is applied one block of one tensor at a time:
    the new global tensor is written over the mean tensor, the old one is read from the
    persistor's checkpoint, so no second model copy is made. The optimizer state (``m``, ``v``: up
    to two model copies in float32) is kept in memory, or, with ``download_to_disk``, in files in
    a ``fedopt_state-*`` folder of the server's workspace that are read and written a block at a
    time (the server's memory stays FedAvg's). The state is in the workflow's checkpoint after
    every round (written a tensor at a time), so a job resumed after the server stopped goes on
    with it; the folder is deleted when the workflow ends, and a new run continued with
    ``start_round`` starts from zero state.

    Example:
        In ``config_fed_server.conf``::

            { id = fedopt, path = engine.workflows.FedOpt,
              args { num_clients = 2, num_rounds = 10, server_optimizer = adam, server_lr = 0.01 } }
    """

    def __init__(
        self,
        *,
        server_optimizer: str = "adam",
        server_lr: float | None = None,
        momentum: float = 0.9,
        beta1: float = 0.9,
        beta2: float = 0.99,
        epsilon: float = 1e-3,
        **fedavg_args: Any,
    ) -> None:
        super().__init__(**fedavg_args)  # checked by a config's validation against FedAvg's signature
        self.optimizer = ServerOptimizer.from_args(server_optimizer, server_lr, momentum, beta1, beta2, epsilon)
        self._state: OptimizerState | None = None

    def run(self) -> None:
        """FedAvg's rounds; the optimizer state is dropped (its folder deleted) when they end, however they end."""
        try:
            super().run()
        finally:
            if self._state is not None:
                self._state.close()
                self._state = None

    def update_global(self, model: FLModel, update: FLModel, current_round: int, reference: dict[str, Any]) -> FLModel:
        """One optimizer step from the global model the clients were sent (``model.params``) along the mean update."""
        if self._state is None:
            self._state = self._new_state()
        params_type = ParamsType(update.params_type) if update.params_type is not None else ParamsType.FULL
        params = self.optimizer.apply(dict(update.params or {}), params_type, model.params or {}, self._state)
        optimizer = self.optimizer
        shown = shown_round(current_round)
        log.info("server optimizer step: round=%d optimizer=%s lr=%g", shown, optimizer.name, optimizer.lr)
        return FLModel(params=params, params_type=ParamsType.FULL, metrics=update.metrics, meta=dict(model.meta))

    def algorithm_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The optimizer's moments (``"<slot>/<param>"``), none before its first step."""
        return {}, ({} if self._state is None else self._state.export_tensors())

    def restore_algorithm_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """The moments of the resumed run, in a fresh store."""
        if self._state is not None:
            self._state.close()
            self._state = None
        if tensors:
            self._state = self._new_state()
            self._state.import_tensors(tensors)

    def _new_state(self) -> OptimizerState:
        """In files with ``download_to_disk`` (blocks as large as `ServerOptimizer.apply` reads), else in memory."""
        if self.download_to_disk and self.optimizer.slots:
            return FileState(self.context.workspace, block_elements(torch.float32, BLOCK_BYTES))
        return MemoryState()
