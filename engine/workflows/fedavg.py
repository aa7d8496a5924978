"""`FedAvg`: federated averaging with InTime aggregation (the `RoundLoop` with its default hooks)."""

from __future__ import annotations

import logging
import math
import random
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
from engine.aggregators.folding import FoldingModelAggregator
from engine.errors import ResultRefused
from engine.model import FLModel, ParamsType
from engine.workflows.round_loop import RoundLoop

log = logging.getLogger(__name__)


class FedAvg(RoundLoop):
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
        site_wait_timeout: Seconds a round waits for sites to come back while fewer than
            ``min_clients`` are alive; then the job ends, naming the dead sites.

    Sites that die (their job process ended, or no heartbeat within the heartbeat timeout) are
    not sampled; one that dies during a round is replaced by a live site that was not sampled
    when the round can no longer get ``min_clients`` results without it, and a round left short
    all the same is played again once enough sites are alive. A site that comes back (its job
    process restarted) is sampled again from the next round on. The round's ``dead`` and
    ``replacements`` (round events and ``summary.json``) say who.

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
        site_wait_timeout: float = 60.0,
    ) -> None:
        super().__init__(persistor_id)
        _check_positive("num_clients", num_clients)
        _check_positive("num_rounds", num_rounds)
        if start_round < 0:
            raise ValueError(f"start_round: expected >= 0, got {start_round}")
        if min_clients is not None and not 1 <= min_clients <= num_clients:
            raise ValueError(f"min_clients: expected 1..num_clients ({num_clients}), got {min_clients}")
        types = ", ".join(t.value for t in ParamsType)
        try:
            self.expected_params_type = ParamsType(expected_params_type)
        except ValueError as e:
            raise ValueError(f"expected_params_type: expected one of {types}, got {expected_params_type!r}") from e
        if sample_fraction is not None and (
            isinstance(sample_fraction, bool)
            or not isinstance(sample_fraction, (int, float))
            or not 0 < sample_fraction <= 1
        ):
            raise ValueError(f"sample_fraction: expected a number in (0, 1], got {sample_fraction!r}")
        if sample_seed is not None and (isinstance(sample_seed, bool) or not isinstance(sample_seed, int)):
            raise ValueError(f"sample_seed: expected an integer, got {sample_seed!r}")
        self.configure_loop(
            num_rounds=num_rounds,
            start_round=start_round,
            min_clients=min_clients,
            wait_time_after_min_received=wait_time_after_min_received,
            train_timeout=train_timeout,
            download_to_disk=download_to_disk,
            download_to_disk_dir=download_to_disk_dir,
            rules=ResultRules.from_args(allow_non_finite, metric_ranges),
            site_wait_timeout=site_wait_timeout,
        )
        self.num_clients = num_clients
        self.aggregation_weights = dict(aggregation_weights or {})
        self.max_local_steps = check_max_local_steps(max_local_steps)
        self.aggregator_id = aggregator_id
        self.sample_fraction = sample_fraction
        self.sample_seed = sample_seed

    def make_aggregator(self) -> ModelAggregator:
        """The ``aggregator_id`` component, else a weighted mean by local steps and ``aggregation_weights``.

        In memory (no ``download_to_disk``) the weighted mean is folded as results arrive, one
        tensor at a time, so results are pulled at once and none is ever whole in memory
        (`FoldingModelAggregator`); with ``download_to_disk`` results are summed from their files.
        """
        if self.aggregator_id is None and not self.download_to_disk:
            return FoldingModelAggregator(
                aggregation_weights=self.aggregation_weights, max_local_steps=self.max_local_steps
            )
        if self.aggregator_id is None:
            return WeightedModelAggregator(
                aggregation_weights=self.aggregation_weights, max_local_steps=self.max_local_steps
            )
        return self.context.get_component(self.aggregator_id, ModelAggregator, key="aggregator_id")

    def round_clients(self, rng: random.Random) -> list[str]:
        """``num_clients`` of the job's live clients (or ``sample_fraction`` of the job's), chosen at random."""
        count = self._sample_count()
        live = self.live_clients()
        if count < len(live):
            return sorted(rng.sample(live, count))
        if count > len(self.get_clients()):
            log.warning("num_clients=%d but only %d clients run the job; using all", count, len(self.get_clients()))
        return live

    def min_live_clients(self) -> int:
        """Sites alive for a round to start: ``min_clients`` (``num_clients`` by default), at most the job's."""
        return min(self.min_clients or self._sample_count(), len(self.get_clients()))

    def check_result(self, result: FLModel, client: str, current_round: int, reference: dict[str, Any]) -> None:
        """Refuse a result of the wrong params type, unlike the model sent, or with non-finite values.

        Raises:
            ResultRefused: The result is refused; nothing of it reached the aggregator.
        """
        params_type = ParamsType(result.params_type) if result.params_type is not None else ParamsType.FULL
        if params_type is not self.expected_params_type:
            raise ResultRefused(
                f"result of {client} has {params_type.value} params, this workflow expects "
                f"{self.expected_params_type.value} (expected_params_type)"
            )
        params = result.params or {}
        if params_type is ParamsType.DIFF:  # a difference may leave names out
            reference = {name: value for name, value in reference.items() if name in params}
        check_params_match(reference, params, client)
        super().check_result(result, client, current_round, reference)

    def update_global(self, model: FLModel, update: FLModel, current_round: int, reference: dict[str, Any]) -> FLModel:
        """The mean itself (FULL), or the old global model plus the mean (DIFF).

        The old weights are read back from the persistor only when needed (a DIFF, or a FULL
        mean that leaves names out).
        """
        params = dict(update.params or {})
        if update.params_type is ParamsType.DIFF or set(params) != set(reference):
            base = self.load_model().params or {}
            if update.params_type is ParamsType.DIFF:
                params = {
                    name: base[name] + torch.as_tensor(delta).to(base[name].dtype) for name, delta in params.items()
                }
            params = {**base, **params}
        return FLModel(params=params, params_type=ParamsType.FULL, metrics=update.metrics, meta=dict(model.meta))

    def _sample_count(self) -> int:
        """Clients to sample this round: ``sample_fraction`` of the job's (rounded up), else ``num_clients``."""
        if self.sample_fraction is None:
            return self.num_clients
        return max(1, math.ceil(self.sample_fraction * len(self.get_clients())))


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
