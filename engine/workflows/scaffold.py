"""`Scaffold`: the server side of SCAFFOLD (Karimireddy et al. 2020): FedAvg plus a control variate."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine.aggregators import ModelAggregator, check_params_match, release_values, resolve_value
from engine.aggregators.check import check_finite
from engine.errors import ResultRefused
from engine.model import FLModel, Shareable, shown_round
from engine.model.convert import model_from_shareable
from engine.model.scaffold_keys import C_DELTA_KEY, C_GLOBAL_KEY
from engine.workflows.fedavg import FedAvg

log = logging.getLogger(__name__)


class Scaffold(FedAvg):
    """FedAvg whose clients correct their local steps with control variates (SCAFFOLD).

    Takes every `FedAvg` arg (the new global model is FedAvg's weighted mean: the paper's global
    step size is 1). The server keeps the control variate ``c``, one tensor per trainable
    floating-point parameter of the model (zeros at first), and sends it with every task in the
    model's meta under ``scaffold_c_global``. Each result must carry the client's change of its
    own control variate under ``scaffold_c_delta`` (what `engine.client.ScaffoldClient.end_round`
    returns); after each round::

        c += (|S| / N) * mean of the accepted results' deltas    # = sum of the deltas / N

    with ``|S|`` the results accepted this round and ``N`` the job's clients (the paper's
    Algorithm 1, line 17). A result whose delta is missing, names other parameters, has another
    shape or dtype, or holds a NaN or an infinity is refused (that site's alone, as FedAvg refuses
    a bad model; ``allow_non_finite`` does not apply to the delta: one NaN in ``c`` would spread to
    every client).

    The trainable parameters are those of the persistor's module with ``requires_grad`` (as the
    client's), else every floating-point tensor of the model.

    Memory: ``c`` and the running sum of the round's deltas are two more copies of the trainable
    parameters on the server (the sum in float32 for float32 and half-precision parameters),
    beside FedAvg's; the task's download serves ``c``'s own tensors (no copy). The deltas are
    summed as the results arrive (one at a time) and never kept; with ``download_to_disk`` they
    arrive as references into the downloaded files and are read one tensor at a time. Every
    task carries ``c`` and every result its delta: about twice FedAvg's traffic each way (a
    result, model and delta, stays within the server's limit of 2 x the model's bytes + 16 MiB).
    ``c`` is in the workflow's checkpoint after every round, so a resumed job goes on with it; a
    new run continued with ``start_round`` starts from zeros.

    Example:
        In ``config_fed_server.conf``::

            { id = scaffold, path = engine.workflows.Scaffold, args { num_clients = 2, num_rounds = 10 } }

        and the clients' training script uses ``flare.ScaffoldClient``.
    """

    _c: dict[str, torch.Tensor] | None = None

    def make_aggregator(self) -> ModelAggregator:
        """FedAvg's aggregator, with the accepted results' control variate changes summed beside it."""
        self._c = None
        return _DeltaSum(super().make_aggregator())

    def task_data(self, model: FLModel, current_round: int) -> Shareable:
        """FedAvg's task, with the control variate in the model's meta (``scaffold_c_global``)."""
        if self._c is None:
            self._c = self._zero_control_variate(model.params or {})
        shareable = super().task_data(model, current_round)
        model_from_shareable(shareable).meta[C_GLOBAL_KEY] = dict(self._c)
        return shareable

    def algorithm_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The control variate ``c`` (``"c/<param>"``), none before the first task."""
        return {}, {f"c/{name}": tensor for name, tensor in (self._c or {}).items()}

    def restore_algorithm_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """``c`` of the resumed run."""
        c = {key[2:]: tensor for key, tensor in tensors.items() if key.startswith("c/")}
        self._c = c or None

    def check_result(self, result: FLModel, client: str, current_round: int, reference: dict[str, Any]) -> None:
        """FedAvg's checks, then the delta's: names and layout those of ``c``, values finite.

        Raises:
            ResultRefused: The result is refused; nothing of it reached the aggregator.
        """
        delta = (result.meta or {}).get(C_DELTA_KEY)
        try:
            super().check_result(result, client, current_round, reference)
            if delta is None:
                raise ResultRefused(
                    f"result of {client} has no {C_DELTA_KEY} meta: the training script must call "
                    "ScaffoldClient.end_round() and send the dict it returns in the result's meta "
                    "(FLModel(params=..., meta={..., **scaffold.end_round()}))"
                )
            self._check_delta(delta, client)
        except BaseException:
            if isinstance(delta, Mapping):
                release_values(delta)  # its files on disk, if any
            raise

    def update_global(self, model: FLModel, update: FLModel, current_round: int, reference: dict[str, Any]) -> FLModel:
        """FedAvg's new model; ``c`` moves by the sum of the round's deltas over the job's clients."""
        new = super().update_global(model, update, current_round, reference)
        sums, count = self._aggregator_sums(update)
        clients = len(self.get_clients())
        if self._c is not None and count:
            # New tensors, not in place (a task still being downloaded keeps the c it was sent),
            # one at a time, each sum dropped once added: c and the sums, plus one tensor, at most.
            for name, c in self._c.items():
                self._c[name] = torch.add(c, sums.pop(name).div_(clients)).to(c.dtype)
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(c)) ** 2 for c in (self._c or {}).values()))
        log.info(
            "scaffold control variate updated: round=%s results=%d clients=%d c_norm=%.6g",
            shown_round(current_round),
            count,
            clients,
            norm,
        )
        return new

    def _zero_control_variate(self, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Zeros shaped as the trainable floating-point parameters of ``params``."""
        trainable = getattr(self.persistor, "trainable_param_names", None)
        names = set(trainable()) if callable(trainable) else None
        return {
            name: torch.zeros(value.shape, dtype=value.dtype)
            for name, value in params.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and (names is None or name in names)
        }

    def _check_delta(self, delta: Any, client: str) -> None:
        if not isinstance(delta, Mapping):
            raise ResultRefused(
                f"result of {client}: {C_DELTA_KEY} must be a dict of tensors, got {type(delta).__name__}"
            )
        for name, value in delta.items():
            if not (hasattr(value, "shape") and hasattr(value, "dtype")):
                what = type(value).__name__
                raise ResultRefused(f"result of {client}: {C_DELTA_KEY}[{name!r}] is not a tensor ({what})")
        try:
            check_params_match(self._c or {}, delta, client)
            check_finite(delta, client)
        except ResultRefused as e:
            raise ResultRefused(f"{C_DELTA_KEY}: {e}") from e

    def _aggregator_sums(self, update: FLModel) -> tuple[dict[str, torch.Tensor], int]:
        sums = update.meta.pop(_SUMS_KEY, None) if update.meta else None
        return sums or ({}, 0)


#: Meta key the aggregate carries the round's delta sum and count under (dropped by `update_global`).
_SUMS_KEY = "_scaffold_delta_sums"


class _DeltaSum(ModelAggregator):
    """The workflow's aggregator, plus the running sum of the accepted results' ``scaffold_c_delta``.

    A delta is added once the wrapped aggregator has accepted the result (a result it refuses
    counts for neither), one tensor at a time, and its values are released right after.
    """

    def __init__(self, inner: ModelAggregator) -> None:
        self.inner = inner
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0

    def start_round(self, current_round: int, load_global: Callable[[], Mapping[str, Any]]) -> None:
        """Forwarded to the wrapped aggregator."""
        self.inner.start_round(current_round, load_global)

    def accept_model(self, model: FLModel, contributor: str) -> None:
        """The wrapped aggregator's accept, then the delta (checked by `Scaffold.check_result`) summed."""
        delta = (model.meta or {}).get(C_DELTA_KEY) or {}
        try:
            self.inner.accept_model(model, contributor)
            for name, value in delta.items():
                tensor = torch.as_tensor(resolve_value(value))
                total = self._sums.get(name)
                if total is None:
                    dtype = torch.promote_types(tensor.dtype, torch.float32)
                    self._sums[name] = tensor.to(dtype=dtype, copy=True)
                else:
                    total.add_(tensor)
                del tensor
            self._count += 1
        finally:
            release_values(delta)

    def aggregate_model(self) -> FLModel:
        """The wrapped aggregate, carrying the round's delta sum and count for `Scaffold.update_global`."""
        update = self.inner.aggregate_model()
        update.meta = {**(update.meta or {}), _SUMS_KEY: (self._sums, self._count)}
        self._sums, self._count = {}, 0
        return update

    def reset_stats(self) -> None:
        """Forget the round's results (the wrapped aggregator's and the delta sum)."""
        self.inner.reset_stats()
        self._sums, self._count = {}, 0
