"""`RoundLoop`: the round loop of every server-side algorithm, driven by a few hooks.

Each round: pick the clients, report ``round_started``, send them the task, check each result
and fold it into the aggregator as it arrives (InTime: nothing is kept), then make the new
global model from the aggregate, report ``round_done``; stop on abort, fail when too few results
are usable. The algorithms (`FedAvg`, `ScatterAndGather`, `FedOpt`) are short modules that fill in
the hooks, as a Flower ``Strategy`` fills in ``configure_fit`` / ``aggregate_fit``:

- `make_aggregator`: the `ModelAggregator` that combines the round's results (the one interface
  the loop speaks: `FLModel` in, `FLModel` out; the DXO aggregators of ScatterAndGather come in
  through `engine.aggregators.DXOAggregatorAsModel`).
- `task_data`: what is sent along, as a `Shareable`.
- `check_result`: what a result must pass before it reaches the aggregator.
- `update_global`: the new global model from the old one and the aggregate.
- `round_clients` and `results_needed`: who is asked, and how many usable results a round needs.

Memory: the model a round starts from is checkpointed in a thread of its own while the clients
download it, and the first result waits for that save; a `task_data` that hands the params over
to the task (FedAvg's) leaves the loop holding no global weights while the clients train.

Sites that die: dead sites are not asked; one that dies mid-round is replaced by a live site not
asked yet, a round left short all the same is played again, and while fewer sites than
`min_live_clients` are alive the loop waits up to ``site_wait_timeout`` (`engine.workflows.round_sites`).

Resuming: once a round's model is saved, the loop records what playing that round again needs
(`engine.workflows.checkpoint`); a job run again after its server stopped resumes there, with the
same sampling draws, the persistor's best model, and the algorithm's state (`algorithm_state`).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from abc import abstractmethod
from typing import Any

import torch

from engine.aggregators import ModelAggregator, ResultRules
from engine.aggregators.folding import FoldingModelAggregator
from engine.aggregators.rules import marked_from_one_site
from engine.controller.context import DiskDownloadArea
from engine.errors import WorkflowError
from engine.fault_points import fault_point
from engine.model import (
    FLModel,
    ParamsType,
    Shareable,
    shareable_from_model,
)
from engine.paths import JobPaths
from engine.workflows.background_save import BackgroundSave
from engine.workflows.checkpoint import RoundCheckpoint, record_round, resume_round_loop
from engine.workflows.downloads import check_download_dir, disk_figures, receiving_to_disk
from engine.workflows.global_params import RoundModelParams
from engine.workflows.model_controller import ModelController
from engine.workflows.round_folding import FoldedResults
from engine.workflows.round_sites import (
    MAX_ROUND_RETRIES,
    RoundTally,
    check_site_wait_timeout,
    draw_replacements,
    wait_for_sites,
)

log = logging.getLogger(__name__)


class RoundLoop(FoldedResults, ModelController):
    """Base of round-based server algorithms: `run` is the loop, subclasses implement the hooks.

    Subclasses set the loop's settings with `configure_loop` in their ``__init__`` (after
    ``super().__init__(persistor_id)``) and implement `make_aggregator`; the other hooks have
    FedAvg's behaviour by default.

    Example:
        The plainest algorithm: the clients' weighted mean (FULL results) is the new model::

            class MeanIsTheModel(RoundLoop):
                def __init__(self, num_rounds: int = 5, min_clients: int | None = None) -> None:
                    super().__init__("persistor")
                    self.configure_loop(num_rounds=num_rounds, min_clients=min_clients)

                def make_aggregator(self) -> ModelAggregator:
                    return WeightedModelAggregator()

                def update_global(self, model, update, current_round, reference) -> FLModel:
                    return FLModel(params=update.params, metrics=update.metrics)

        To change one step of an existing algorithm, subclass it instead (`FedOpt` is `FedAvg`
        with its own `update_global`).
    """

    resumable = True
    num_rounds: int = 1
    start_round: int = 0
    min_clients: int | None = None
    wait_time_after_min_received: float = 0.0
    train_timeout: float = 0.0
    task_name: str = "train"
    ignore_result_error: bool = True
    download_to_disk: bool = False
    download_to_disk_dir: str | None = None
    sample_seed: int | None = None
    site_wait_timeout: float = 60.0
    rules: ResultRules = ResultRules()

    def configure_loop(
        self,
        *,
        num_rounds: int,
        start_round: int = 0,
        min_clients: int | None = None,
        wait_time_after_min_received: float = 0.0,
        train_timeout: float = 0.0,
        task_name: str = "train",
        ignore_result_error: bool = True,
        download_to_disk: bool = False,
        download_to_disk_dir: str | None = None,
        rules: ResultRules | None = None,
        site_wait_timeout: float = 60.0,
    ) -> None:
        """Set the loop's settings (the algorithm's constructor has checked its args).

        Args:
            num_rounds: Rounds to run.
            start_round: The first round's number (0-based).
            min_clients: Usable results a round needs (see `results_needed`).
            wait_time_after_min_received: Seconds to wait for more results once enough are in.
            train_timeout: Seconds a round's task may take (0 = no limit).
            task_name: The task's name (executors are chosen by it).
            ignore_result_error: Go on when a client's result is an error, as long as enough
                results are usable; otherwise the task is cancelled at the first one and the
                round fails.
            download_to_disk: Results download to disk first while the loop runs.
            download_to_disk_dir: Where they go (see `receiving_to_disk`).
            rules: The checks of every result (non-finite values, metric ranges).
            site_wait_timeout: Seconds a round waits for sites to come back while fewer than it
                needs are alive (`min_live_clients`); then the job ends naming the dead sites.
        """
        self.num_rounds = num_rounds
        self.start_round = start_round
        self.min_clients = min_clients
        self.wait_time_after_min_received = wait_time_after_min_received
        self.train_timeout = train_timeout
        self.task_name = task_name
        self.ignore_result_error = ignore_result_error
        self.download_to_disk = download_to_disk
        self.download_to_disk_dir = download_to_disk_dir
        self.rules = rules or ResultRules()
        self.site_wait_timeout = check_site_wait_timeout(site_wait_timeout)

    # -- hooks --------------------------------------------------------------------------------------

    @abstractmethod
    def make_aggregator(self) -> ModelAggregator:
        """The aggregator of the run's rounds (called once per `run`)."""

    def round_clients(self, rng: random.Random) -> list[str]:
        """The clients asked this round: all of the job's that are alive, by default.

        Args:
            rng: The run's random source, seeded with ``sample_seed`` (for sampling that repeats).
        """
        return self.live_clients()

    def min_live_clients(self) -> int:
        """Sites that must be alive for a round to start: ``min_clients`` (all of the job's by default)."""
        clients = self.get_clients()
        return min(self.min_clients or len(clients), len(clients))

    def results_needed(self, clients: list[str]) -> int:
        """Usable results this round needs: ``min_clients``, at most the clients asked (all of them by default)."""
        return min(self.min_clients or len(clients), len(clients))

    def task_data(self, model: FLModel, current_round: int) -> Shareable:
        """The task for ``model``: by default the model itself, its params handed over to the task.

        The loop keeps no reference to what this returns, so params handed over (``model.params``
        set to None) are freed once every client has been sent them.
        """
        params, model.params = model.params, None
        return shareable_from_model_params(model, params, current_round, self.num_rounds, self.start_round)

    def check_result(self, result: FLModel, client: str, current_round: int, reference: dict[str, Any]) -> None:
        """Refuse a result by raising `ResultRefused` (the site's alone; the round goes on).

        Anything else it raises is a bug in the check, not the site's refusal: the result fails,
        logged with the traceback, and is reported in the round's ``failed``, never ``refused``
        (`engine.aggregators.refusals`).

        Args:
            result: The client's result (its metrics may be filtered in place).
            client: Who sent it.
            current_round: The round.
            reference: Names, shapes and dtypes of the model sent (meta tensors, no memory).
        """
        self.rules.check_values(result.params or {}, client)
        result.metrics = self.rules.accepted_metrics(result.metrics, client, current_round) or None

    def algorithm_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The algorithm's state between rounds that a resumed run needs: (JSON values, tensors); none by default.

        Called after a round's model is saved, while the next round runs (the state must not
        change until `update_global`). FedOpt gives its optimizer's moments, SCAFFOLD its
        control variate.
        """
        return {}, {}

    def restore_algorithm_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Take back what `algorithm_state` gave, when the run resumes (after `make_aggregator`)."""

    @abstractmethod
    def update_global(self, model: FLModel, update: FLModel, current_round: int, reference: dict[str, Any]) -> FLModel:
        """The new global model from the round's ``model`` and the aggregate.

        Args:
            model: The model the round started from; ``model.params`` are the weights its clients
                were sent. When the task took them (`task_data`), they are a `RoundModelParams`
                that reads them back from the persistor on first access (a block at a time
                where the persistor can), so an algorithm that needs them just reads them.
            update: The aggregate of the round's results (``aggregate_model``).
            current_round: The round (0-based).
            reference: Names, shapes and dtypes of the model sent (meta tensors, no memory).
        """

    # -- the loop -----------------------------------------------------------------------------------

    def live_clients(self) -> list[str]:
        """The job's clients that are not dead (their process ended, or no heartbeat), in the job's order."""
        dead = self.context.dead()
        return [client for client in self.get_clients() if client not in dead]

    def use_job_paths(self, paths: JobPaths) -> None:
        """At job start: refuse a ``download_to_disk_dir`` outside the site's folders (see `check_download_dir`)."""
        check_download_dir(paths, self.download_to_disk, self.download_to_disk_dir)

    def run(self) -> None:
        """Run the rounds (downloading results to disk while it does, with ``download_to_disk``)."""
        with receiving_to_disk(self.context, self.download_to_disk, self.download_to_disk_dir) as area:
            self._run_rounds(area)

    def _run_rounds(self, area: DiskDownloadArea | None) -> None:
        aggregator = self.make_aggregator()
        # Sites whose result was refused midway once: their results are taken whole from then on,
        # so a site cannot make the server pull every other result twice each round.
        self._whole_from: set[str] = set()
        # The last round's metrics that one site alone reported: its model is not a best candidate by them.
        self._from_one_site: list[str] = []
        rng = random.Random(self.sample_seed)
        checkpoint = RoundCheckpoint(self.context.checkpoint_dir) if self.context.checkpoint_dir else None
        first_round = None
        if checkpoint is not None and self.context.resuming:
            first_round = resume_round_loop(self, checkpoint, rng)
        model = self.load_model()
        model.total_rounds = self.num_rounds
        end = self.start_round + self.num_rounds
        for current_round in range(self.start_round if first_round is None else first_round, end):
            if self.abort_signal.is_set():
                break  # the last round's model is still saved
            started = time.monotonic()
            tally = self._play_round(aggregator, model, current_round, rng, checkpoint)
            if tally is None or self.abort_signal.is_set():
                return
            update = aggregator.aggregate_model()
            if model.params is None:  # handed to the task: read back from the persistor if update_global asks
                model.params = RoundModelParams(self.persistor.global_params_for_reading)  # type: ignore[assignment]
            model = self.update_global(model, update, current_round, tally.reference)
            del update  # its tensors are the new model's: held by `model` alone from here on
            model.current_round = current_round
            model.total_rounds = self.num_rounds
            self._from_one_site = tally.metrics_from_one_site(len(self.get_clients()))
            self.context.report(
                "round_done",
                round=current_round,
                total_rounds=self.num_rounds,
                time_s=round(time.monotonic() - started, 3),
                metrics=dict(model.metrics or {}),
                clients=sorted(tally.accepted),
                sampled=tally.asked,
                failed=dict(self.failures),
                refused=dict(self.refused),
                **tally.site_fields(self.context.dead_reasons()),
                **({"metrics_from_one_site": list(self._from_one_site)} if self._from_one_site else {}),
                **disk_figures(area, current_round),
            )
        self.save_model(self._for_persistor(model))
        if checkpoint is not None and not self.abort_signal.is_set():
            record_round(self, checkpoint, end, rng.getstate(), set(self._whole_from))

    def _play_round(
        self,
        aggregator: ModelAggregator,
        model: FLModel,
        current_round: int,
        rng: random.Random,
        checkpoint: RoundCheckpoint | None = None,
    ) -> RoundTally | None:
        """Gather the round's results into ``aggregator``; None when the job was aborted meanwhile.

        Sites found dead are not asked. A site that dies during the round is replaced by a live
        one that was not asked (when the loop samples); a round left short by deaths is played
        again (at most `MAX_ROUND_RETRIES` times) once enough sites are alive.

        Raises:
            WorkflowError: Too few sites alive for longer than ``site_wait_timeout``, or too few
                usable results for a reason other than deaths.
        """
        # The model this round starts from is checkpointed while the clients download it (from
        # the first round on, the persistor can give the global model back). The first result
        # waits for that save: the old weights are gone before results pile up.
        reference = layout_of(model.params or {})
        saving: BackgroundSave | None = None
        # Once the round's model is saved, the checkpoint records what playing this round again needs.
        after_save = None
        if checkpoint is not None:
            after_save = functools.partial(
                record_round, self, checkpoint, current_round, rng.getstate(), set(self._whole_from)
            )
        for attempt in range(MAX_ROUND_RETRIES + 1):
            wait_for_sites(
                self.context,
                self.live_clients,
                len(self.get_clients()),
                self.min_live_clients(),
                self.site_wait_timeout,
                self.abort_signal,
                current_round,
            )
            if self.abort_signal.is_set():
                return None
            tally = RoundTally(asked=self.round_clients(rng), reference=reference)
            needed = self.results_needed(tally.asked)
            self.context.report(
                "round_started", round=current_round, total_rounds=self.num_rounds, clients=list(tally.asked)
            )
            aggregator.reset_stats()
            aggregator.start_round(current_round, functools.partial(self._global_params, model))
            if saving is None:
                saving = BackgroundSave(self.save_model, self._for_persistor(model), after_save)
            self._gather(aggregator, model, current_round, rng, tally, needed, saving)
            if self.abort_signal.is_set():
                return None
            lost = tally.lost(self.context.dead())
            if len(tally.accepted) < needed and lost and attempt < MAX_ROUND_RETRIES:
                log.warning(
                    "round %d played again: %d usable result(s), %d needed; lost: %s",
                    current_round + 1,
                    len(tally.accepted),
                    needed,
                    ", ".join(lost),
                )
                self.context.report("round_retried", round=current_round, lost=lost, failed=dict(self.failures))
                continue
            self._check_round(current_round, tally.accepted, needed)
            return tally
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _gather(
        self,
        aggregator: ModelAggregator,
        model: FLModel,
        current_round: int,
        rng: random.Random,
        tally: RoundTally,
        needed: int,
        saving: BackgroundSave,
    ) -> None:
        """Send the round's task to ``tally.asked``, take their results; ask live replacements for sites that died."""
        accept = functools.partial(self._accept, aggregator, tally, saving, current_round)
        # Results are folded chunk by chunk into the aggregator's sum as they arrive. One that
        # fails midway (its sender died, a NaN in its last tensor, a straggler cut off when
        # the round closed) taints the sum, which is then rebuilt from the other results
        # (pulled once more from their senders, who hold them until the round's mean exists).
        receiver = None
        if isinstance(aggregator, FoldingModelAggregator) and not self.download_to_disk:
            receiver = functools.partial(self._receive, aggregator, tally.reference, saving, current_round)
        targets = list(tally.asked)
        try:
            while targets:
                self.send_and_gather(
                    self.task_data(self._model_to_send(model, saving), current_round),
                    targets=targets,
                    task_name=self.task_name,
                    current_round=current_round,
                    total_rounds=self.num_rounds,
                    timeout=self.train_timeout,
                    wait_time_after_min_received=self.wait_time_after_min_received,
                    min_responses=min(max(needed - len(tally.accepted), 0), len(targets)),
                    callback=accept,
                    release_after_send=True,
                    cancel_on_error=not self.ignore_result_error,
                    result_receiver=receiver,
                )
                tally.take_outcomes(self.failures, self.refused, self.errors, self.died)
                stop_on_error = bool(self.errors) and not self.ignore_result_error
                if len(tally.accepted) >= needed or self.abort_signal.is_set() or stop_on_error:
                    break
                count = needed - len(tally.accepted)
                targets = draw_replacements(self.context, self.live_clients(), rng, tally, count, current_round)
        finally:
            saving.wait()
            if receiver is not None:
                aggregator.close()  # results still open fail (and taint the sum if they folded anything)
        self.failures, self.refused, self.errors = tally.failures, tally.refused, tally.errors
        if receiver is not None and aggregator.tainted() and len(tally.accepted) >= needed:
            self._rebuild(aggregator, tally.accepted, current_round)  # else the round fails below

    def _for_persistor(self, model: FLModel) -> FLModel:
        """``model`` as the persistor is given it: its meta names the metrics one site alone decided.

        The persistor picks no best model by such a metric (`MetaKey.METRICS_FROM_ONE_SITE`).
        The list goes to the persistor only, not into the model the clients are sent.
        """
        return marked_from_one_site(model, self._from_one_site)

    def _model_to_send(self, model: FLModel, saving: BackgroundSave) -> FLModel:
        """``model``, or, once its params were handed to a task, the same model read back from its checkpoint."""
        if model.params is not None:
            return model
        saving.wait()  # the round's model is on disk once its save is over
        return FLModel(
            params=self.load_model().params,
            params_type=model.params_type,
            metrics=model.metrics,
            meta=dict(model.meta or {}),
            current_round=model.current_round,
            total_rounds=model.total_rounds,
        )

    def _check_round(self, current_round: int, accepted: list[str], needed: int) -> None:
        """Raise when a client's error ends the round (``ignore_result_error`` off) or too few results are usable."""
        if self.errors and not self.ignore_result_error:
            raise WorkflowError(f"round {current_round + 1}: a client's result is an error: {self.errors}")
        if self.abort_signal.is_set():
            return
        if len(accepted) < needed:
            reasons = "; ".join(f"{client}: {why}" for client, why in sorted(self.failures.items()))
            raise WorkflowError(
                f"round {current_round + 1}: {len(accepted)} usable result(s), "
                f"{needed} needed (min_clients); {reasons or 'no reason reported'}"
            )

    def _accept(
        self,
        aggregator: ModelAggregator,
        tally: RoundTally,
        saving: BackgroundSave,
        current_round: int,
        result: FLModel,
        client: str,
    ) -> None:
        """Check one result, then fold it into the round's aggregate (``tally`` notes it and its metrics).

        Raises:
            ResultRefused: The result is refused; nothing of it reached the aggregator.
        """
        saving.join()  # its failure is the workflow's to raise, not this result's
        self.check_result(result, client, current_round, tally.reference)
        aggregator.accept_model(result, client)
        tally.metric_names[client] = _metric_names(result)
        tally.accepted.append(client)
        fault_point("result_aggregated")  # the fault suite's hook: a crash mid-aggregation


def shareable_from_model_params(
    model: FLModel, params: dict[str, Any] | None, current_round: int, total_rounds: int, start_round: int
) -> Shareable:
    """The task data of the FLModel path: ``params`` as FULL weights of ``current_round``."""
    return shareable_from_model(
        FLModel(
            params=params,
            params_type=ParamsType.FULL,
            current_round=current_round,
            total_rounds=total_rounds,
            start_round=start_round,
        )
    )


def _metric_names(result: FLModel) -> list[str]:
    """The names of a checked result's metrics: its own, and a DXO's ``metrics`` meta (ScatterAndGather)."""
    in_meta = (result.meta or {}).get("metrics")
    return list(dict.fromkeys([*(result.metrics or {}), *(in_meta if isinstance(in_meta, dict) else {})]))


def layout_of(params: dict[str, Any]) -> dict[str, Any]:
    """Stand-ins with the names, shapes and dtypes of ``params`` and no memory (meta tensors)."""
    return {
        name: torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value
        for name, value in params.items()
    }
