"""`FedAvg`: federated averaging with InTime aggregation, in the style of a model controller."""

from __future__ import annotations

import functools
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.aggregators import (
    DEFAULT_MAX_LOCAL_STEPS,
    ModelAggregator,
    ResultRules,
    WeightedModelAggregator,
    check_max_local_steps,
    check_params_match,
)
from engine.controller.context import DiskDownloadArea
from engine.model import FLModel, ParamsType
from engine.paths import JobPaths
from engine.workflows.downloads import check_download_dir, disk_figures, receiving_to_disk
from engine.workflows.model_controller import ModelController

log = logging.getLogger(__name__)


class FedAvg(ModelController):
    """Each round: send the global model to the clients, fold every result into a weighted sum as it
    arrives (then drop it), replace the global model by the weighted mean, save it.

    Args:
        num_clients: Clients sampled per round (all clients when the job has fewer).
        num_rounds: Rounds to run.
        start_round: The first round's number (to continue an earlier run).
        persistor_id: Id of the `ModelPersistor` component.
        aggregation_weights: Site -> weight, multiplied with each result's
            ``NUM_STEPS_CURRENT_ROUND`` meta (default 1.0 per site).
        max_local_steps: The largest ``NUM_STEPS_CURRENT_ROUND`` a result may claim (the
            default aggregator's bound; a result above it, or at most 0, is refused).
        aggregator_id: Id of a custom `ModelAggregator` component; a weighted mean by default.
        min_clients: Usable results a round needs; ``num_clients`` by default. With fewer the
            job ends with FINISHED_EXECUTION_EXCEPTION and the reasons.
        wait_time_after_min_received: Seconds to wait for more results once ``min_clients``
            results are in.
        train_timeout: Seconds a round's training may take (0 = no limit).
        download_to_disk: While the workflow runs, the clients' results download to disk
            first (one file per result) and are aggregated one tensor at a time, so the server's
            memory does not grow with the number of clients. Clients are unaffected.
        download_to_disk_dir: Where those downloads go; a folder under the server's workspace
            by default (``downloads``), relative paths from there. It must lie inside the
            workspace or a folder the site allows (``--allow-dir``). Leftovers of a crashed run
            in it are deleted when the next run opens it.
        expected_params_type: What the clients send: ``FULL`` weights (the default) or a
            ``DIFF`` from the weights they were sent. A result of the other type is refused
            (that site's alone).
        allow_non_finite: Accept results holding NaN or infinite values (refused by default).
        metric_ranges: Metric name -> ``[low, high]``: a site's reported value outside is
            dropped (logged), e.g. ``{ global_accuracy = [0, 1] }``.
        sample_fraction: Sample this fraction of the job's clients each round (at least one,
            rounded up) instead of ``num_clients``; None: ``num_clients``.
        sample_seed: Seed of the per-round sampling, so a run samples the same clients again;
            None: a new random choice each run. The clients each round sampled are in its
            ``sampled`` (round events and ``summary.json``).

    A refused result (wrong round or type, names, shapes or dtypes unlike the model's, a
    non-finite value, an out-of-bounds weight) costs that site its contribution to the round,
    nothing else: it is logged with the site, the round and the reason, reported in the round's
    ``refused`` and the run's summary, and the round goes on with the others as long as
    ``min_clients`` results are usable.
    """

    def __init__(
        self,
        num_clients: int = 2,
        num_rounds: int = 5,
        start_round: int = 0,
        persistor_id: str = "persistor",
        aggregation_weights: dict[str, float] | None = None,
        max_local_steps: float = DEFAULT_MAX_LOCAL_STEPS,
        aggregator_id: str | None = None,
        min_clients: int | None = None,
        wait_time_after_min_received: float = 0.0,
        train_timeout: float = 0.0,
        download_to_disk: bool = False,
        download_to_disk_dir: str | None = None,
        expected_params_type: str = "FULL",
        allow_non_finite: bool = False,
        metric_ranges: dict[str, list[float]] | None = None,
        sample_fraction: float | None = None,
        sample_seed: int | None = None,
    ) -> None:
        super().__init__(persistor_id)
        _check_positive("num_clients", num_clients)
        _check_positive("num_rounds", num_rounds)
        if start_round < 0:
            raise ValueError(f"start_round: expected >= 0, got {start_round}")
        if min_clients is not None and not 1 <= min_clients <= num_clients:
            raise ValueError(f"min_clients: expected 1..num_clients ({num_clients}), got {min_clients}")
        self.num_clients = num_clients
        self.num_rounds = num_rounds
        self.start_round = start_round
        self.aggregation_weights = dict(aggregation_weights or {})
        self.max_local_steps = check_max_local_steps(max_local_steps)
        self.aggregator_id = aggregator_id
        self.min_clients = min_clients
        self.wait_time_after_min_received = wait_time_after_min_received
        self.train_timeout = train_timeout
        self.download_to_disk = download_to_disk
        self.download_to_disk_dir = download_to_disk_dir
        types = ", ".join(t.value for t in ParamsType)
        try:
            self.expected_params_type = ParamsType(expected_params_type)
        except ValueError as e:
            raise ValueError(f"expected_params_type: expected one of {types}, got {expected_params_type!r}") from e
        self.rules = ResultRules.from_args(allow_non_finite, metric_ranges)
        if sample_fraction is not None and (
            isinstance(sample_fraction, bool)
            or not isinstance(sample_fraction, (int, float))
            or not 0 < sample_fraction <= 1
        ):
            raise ValueError(f"sample_fraction: expected a number in (0, 1], got {sample_fraction!r}")
        if sample_seed is not None and (isinstance(sample_seed, bool) or not isinstance(sample_seed, int)):
            raise ValueError(f"sample_seed: expected an integer, got {sample_seed!r}")
        self.sample_fraction = sample_fraction
        self.sample_seed = sample_seed

    def use_job_paths(self, paths: JobPaths) -> None:
        """At job start: refuse a ``download_to_disk_dir`` outside the site's folders (see `check_download_dir`)."""
        check_download_dir(paths, self.download_to_disk, self.download_to_disk_dir)

    def run(self) -> None:
        with receiving_to_disk(self.context, self.download_to_disk, self.download_to_disk_dir) as area:
            self._run_rounds(area)

    def _run_rounds(self, area: DiskDownloadArea | None) -> None:
        aggregator = self._aggregator()
        rng = random.Random(self.sample_seed)
        model = self.load_model()
        model.total_rounds = self.num_rounds
        last_round = self.start_round + self.num_rounds
        for current_round in range(self.start_round, last_round):
            if self.abort_signal.is_set():
                break  # the last round's model is still saved
            started = time.monotonic()
            clients = self.sample_clients(self._sample_count(), rng)
            needed = min(self.min_clients or len(clients), len(clients))
            self.context.report("round_started", round=current_round, total_rounds=self.num_rounds, clients=clients)
            aggregator.reset_stats()
            aggregator.start_round(current_round, self._global_params)
            accepted: list[str] = []

            # The model this round starts from is checkpointed while the clients download it
            # (from the first round on, the persistor can give the global model back). The
            # first result waits for that save: the old weights are gone before results pile up.
            # While the clients train, the global weights are held by nobody here: the checks
            # need names, shapes and dtypes only, and the task lets go once every client has it.
            saving = _BackgroundSave(self.save_model, model)
            reference = _layout_of(model.params or {})
            accept = functools.partial(self._accept, aggregator, reference, accepted, saving, current_round)
            try:
                self.send_model_and_wait(
                    targets=clients,
                    data=FLModel(
                        params=_take_params(model),
                        params_type=ParamsType.FULL,
                        current_round=current_round,
                        total_rounds=self.num_rounds,
                        start_round=self.start_round,
                    ),
                    release_after_send=True,
                    timeout=self.train_timeout,
                    min_responses=needed,
                    wait_time_after_min_received=self.wait_time_after_min_received,
                    callback=accept,
                )
            finally:
                saving.wait()
            if self.abort_signal.is_set():
                return
            if len(accepted) < needed:
                reasons = "; ".join(f"{client}: {why}" for client, why in sorted(self.failures.items()))
                raise RuntimeError(
                    f"round {current_round + 1}: {len(accepted)} usable result(s), "
                    f"{needed} needed (min_clients); {reasons or 'no reason reported'}"
                )
            update = aggregator.aggregate_model()
            model = _apply(model, update, current_round, reference, self.load_model)
            del update  # its tensors are the new model's: held by `model` alone from here on
            self.context.report(
                "round_done",
                round=current_round,
                total_rounds=self.num_rounds,
                time_s=round(time.monotonic() - started, 3),
                metrics=dict(model.metrics or {}),
                clients=sorted(accepted),
                sampled=clients,
                failed=dict(self.failures),
                refused=dict(self.refused),
                **disk_figures(area, current_round),
            )
        self.save_model(model)

    def _accept(
        self,
        aggregator: ModelAggregator,
        reference: dict[str, Any],
        accepted: list[str],
        saving: _BackgroundSave,
        current_round: int,
        result: FLModel,
        client: str,
    ) -> None:
        """Check one result (type, layout, values, metrics), then fold it into the round's aggregate.

        Raises:
            ValueError: The result is refused; nothing of it reached the aggregator.
        """
        saving.join()  # its failure is the workflow's to raise, not this result's
        params_type = ParamsType(result.params_type) if result.params_type is not None else ParamsType.FULL
        if params_type is not self.expected_params_type:
            raise ValueError(
                f"result of {client} has {params_type.value} params, this workflow expects "
                f"{self.expected_params_type.value} (expected_params_type)"
            )
        params = result.params or {}
        if params_type is ParamsType.DIFF:  # a difference may leave names out
            reference = {name: value for name, value in reference.items() if name in params}
        check_params_match(reference, params, client)
        self.rules.check_values(params, client)
        result.metrics = self.rules.accepted_metrics(result.metrics, client, current_round) or None
        aggregator.accept_model(result, client)
        accepted.append(client)

    def _sample_count(self) -> int:
        """Clients to sample this round: ``sample_fraction`` of the job's (rounded up), else ``num_clients``."""
        if self.sample_fraction is None:
            return self.num_clients
        return max(1, math.ceil(self.sample_fraction * len(self.get_clients())))

    def _global_params(self) -> dict[str, Any]:
        """The global model as last saved (what the clients were sent this round), read on demand if it can be."""
        return dict(self.persistor.global_params_for_reading())

    def _aggregator(self) -> ModelAggregator:
        if self.aggregator_id is None:
            return WeightedModelAggregator(
                aggregation_weights=self.aggregation_weights, max_local_steps=self.max_local_steps
            )
        return self.context.get_component(self.aggregator_id, ModelAggregator, key="aggregator_id")


class _BackgroundSave:
    """``save(model)`` in a thread of its own, so the clients download the model meanwhile."""

    def __init__(self, save: Callable[[FLModel], None], model: FLModel) -> None:
        self._error: BaseException | None = None
        snapshot = FLModel(params=model.params, params_type=model.params_type, metrics=model.metrics, meta=model.meta)
        self._thread = threading.Thread(target=self._run, args=(save, snapshot), name="fedavg-save", daemon=True)
        self._thread.start()

    def _run(self, save: Callable[[FLModel], None], model: FLModel) -> None:
        try:
            save(model)
        except BaseException as e:  # noqa: BLE001 - raised by wait() in the workflow's thread
            self._error = e

    def join(self) -> None:
        """Return once the save is over (written or failed)."""
        self._thread.join()

    def wait(self) -> None:
        """Return once the save is over; raise its error if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def _layout_of(params: dict[str, Any]) -> dict[str, Any]:
    """Stand-ins with the names, shapes and dtypes of ``params`` and no memory (meta tensors)."""
    return {
        name: torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value
        for name, value in params.items()
    }


def _take_params(model: FLModel) -> dict[str, Any] | None:
    """Hand over ``model.params``, leaving the model without them."""
    params, model.params = model.params, None
    return params


def _apply(
    model: FLModel,
    update: FLModel,
    current_round: int,
    reference: dict[str, Any],
    load_global: Callable[[], FLModel],
) -> FLModel:
    """The new global model: the mean itself (FULL), or the old one plus the mean (DIFF).

    The old weights are read back from the persistor only when needed (a DIFF, or a FULL
    mean that leaves names out).
    """
    params = dict(update.params or {})
    if update.params_type is ParamsType.DIFF or set(params) != set(reference):
        base = load_global().params or {}
        if update.params_type is ParamsType.DIFF:
            params = {name: base[name] + torch.as_tensor(delta).to(base[name].dtype) for name, delta in params.items()}
        params = {**base, **params}
    return FLModel(
        params=params,
        params_type=ParamsType.FULL,
        metrics=update.metrics,
        meta=dict(model.meta),
        current_round=current_round,
        total_rounds=model.total_rounds,
    )


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
