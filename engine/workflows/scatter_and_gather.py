"""`ScatterAndGather`: federated averaging on the DXO path (`RoundLoop`, a DXO aggregator, a shareable generator)."""

from __future__ import annotations

import logging
import random
from typing import Any

from engine.aggregators import Aggregator, DXOAggregatorAsModel, ModelAggregator, ResultRules
from engine.errors import WorkflowError
from engine.model import FLModel, Shareable, dxo_from_model
from engine.workflows.round_loop import RoundLoop
from engine.workflows.shareable_generator import ShareableGenerator

log = logging.getLogger(__name__)


class ScatterAndGather(RoundLoop):
    """Each round: scatter the global model (a DXO) as the ``train`` task, gather results into the
    aggregator as they arrive, apply the aggregate through the shareable generator, save.

    The round loop is `RoundLoop`'s (FedAvg's): the aggregator is used through
    `DXOAggregatorAsModel`, the model a round starts from is saved while the clients download
    it, and the last one when the rounds end. Unlike FedAvg's, the global model stays in memory
    for the whole round (the shareable generator applies the aggregate to it).

    Args:
        min_clients: Results a round needs (the task waits for this many).
        num_rounds: Rounds to run.
        start_round: The first round's number.
        wait_time_after_min_received: Seconds to wait for more results once ``min_clients`` are in.
        aggregator_id: Id of an `Aggregator` component (e.g. ``engine.aggregators.DXOAggregator``).
        persistor_id: Id of a `ModelPersistor` component.
        shareable_generator_id: Id of a `ShareableGenerator` component
            (e.g. ``engine.workflows.FullModelShareableGenerator``).
        train_task_name: The task's name.
        train_timeout: Seconds a round's task may take (0 = no limit).
        ignore_result_error: Go on when a client's result is an error (as long as
            ``min_clients`` usable results arrive); otherwise the job ends at the first one.
        download_to_disk: While the workflow runs, the clients' results download to disk first
            and the aggregator reads them one tensor at a time (as for `FedAvg`).
        download_to_disk_dir: Where those downloads go (as for `FedAvg`).
        allow_non_finite: Accept results holding NaN or infinite values (refused by default).
        metric_ranges: Metric name -> ``[low, high]``; a value outside is dropped (as for `FedAvg`).
        site_wait_timeout: Seconds a round waits for sites to come back while fewer than
            ``min_clients`` are alive (as for `FedAvg`: dead sites are not asked).

    A result that fails a check (non-finite values, or refused by the aggregator: wrong round,
    kind or weight) is refused for that site alone, logged with the site, the round and the
    reason, and reported in the round's ``refused``; unlike a client's error it never ends the
    job, whatever ``ignore_result_error`` says, while ``min_clients`` results are usable.
    """

    def __init__(
        self,
        min_clients: int = 1,
        num_rounds: int = 5,
        start_round: int = 0,
        wait_time_after_min_received: float = 10.0,
        aggregator_id: str = "aggregator",
        persistor_id: str = "persistor",
        shareable_generator_id: str = "shareable_generator",
        train_task_name: str = "train",
        train_timeout: float = 0.0,
        ignore_result_error: bool = False,
        download_to_disk: bool = False,
        download_to_disk_dir: str | None = None,
        allow_non_finite: bool = False,
        metric_ranges: dict[str, list[float]] | None = None,
        site_wait_timeout: float = 60.0,
    ) -> None:
        super().__init__(persistor_id)
        if min_clients < 1 or num_rounds < 1 or start_round < 0:
            raise ValueError(
                f"min_clients and num_rounds must be >= 1 and start_round >= 0, got "
                f"min_clients={min_clients} num_rounds={num_rounds} start_round={start_round}"
            )
        self.configure_loop(
            num_rounds=num_rounds,
            start_round=start_round,
            min_clients=min_clients,
            wait_time_after_min_received=wait_time_after_min_received,
            train_timeout=train_timeout,
            task_name=train_task_name,
            ignore_result_error=ignore_result_error,
            download_to_disk=download_to_disk,
            download_to_disk_dir=download_to_disk_dir,
            rules=ResultRules.from_args(allow_non_finite, metric_ranges),
            site_wait_timeout=site_wait_timeout,
        )
        self.aggregator_id = aggregator_id
        self.shareable_generator_id = shareable_generator_id
        self.train_task_name = train_task_name

    @property
    def generator(self) -> ShareableGenerator:
        """The ``shareable_generator_id`` component."""
        return self.context.get_component(self.shareable_generator_id, ShareableGenerator, key="shareable_generator_id")

    def make_aggregator(self) -> ModelAggregator:
        """The ``aggregator_id`` component: a DXO `Aggregator`, adapted to the round loop's interface."""
        aggregator = self.context.get_component(self.aggregator_id, Aggregator, key="aggregator_id")
        self.generator  # noqa: B018 - a missing generator fails the run here, before any round
        return DXOAggregatorAsModel(aggregator)

    def round_clients(self, rng: random.Random) -> list[str]:
        """All of the job's clients that are alive.

        Raises:
            WorkflowError: Fewer clients run the job than ``min_clients``.
        """
        clients = self.get_clients()
        if len(clients) < self.min_clients:
            raise WorkflowError(f"min_clients={self.min_clients} but only {len(clients)} clients run the job")
        return self.live_clients()

    def min_live_clients(self) -> int:
        """``min_clients``: the sites that must be alive for a round to start."""
        return self.min_clients

    def results_needed(self, clients: list[str]) -> int:
        """``min_clients``."""
        return self.min_clients

    def task_data(self, model: FLModel, current_round: int) -> Shareable:
        """The shareable generator's task data for ``model``.

        The model stays held here: the generator applies the round's aggregate to it.
        """
        return self.generator.learnable_to_shareable(model)

    def check_result(self, result: FLModel, client: str, current_round: int, reference: dict[str, Any]) -> None:
        """Refuse non-finite values; drop metrics outside their ranges (a METRICS DXO's and the ``metrics`` meta's)."""
        super().check_result(result, client, current_round, reference)
        if "metrics" in result.meta:
            result.meta["metrics"] = self.rules.accepted_metrics(result.meta["metrics"], client, current_round)

    def update_global(self, model: FLModel, update: FLModel, current_round: int, reference: dict[str, Any]) -> FLModel:
        """The shareable generator's new model from the aggregate (as the DXO the aggregator made) and ``model``."""
        return self.generator.shareable_to_learnable(dxo_from_model(update).to_shareable(), model)
