"""`ScatterAndGather`: the DXO path of federated averaging (aggregator, shareable generator, persistor)."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from engine.aggregators import Aggregator, ResultRules, release_values
from engine.controller import ClientTask, Controller, ResultRefused, Task
from engine.controller.context import DiskDownloadArea
from engine.model import DXO, FLModel, ReservedHeaderKey, ReturnCode, Shareable
from engine.paths import JobPaths
from engine.persistors import ModelPersistor
from engine.workflows.downloads import check_download_dir, disk_figures, receiving_to_disk, with_real_tensors
from engine.workflows.model_controller import REASON_HEADER
from engine.workflows.shareable_generator import ShareableGenerator

log = logging.getLogger(__name__)


class ScatterAndGather(Controller):
    """Each round: scatter the global model (a DXO) as the ``train`` task, gather results into the
    aggregator as they arrive, apply the aggregate through the shareable generator, save.

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
    ) -> None:
        super().__init__()
        if min_clients < 1 or num_rounds < 1 or start_round < 0:
            raise ValueError(
                f"min_clients and num_rounds must be >= 1 and start_round >= 0, got "
                f"min_clients={min_clients} num_rounds={num_rounds} start_round={start_round}"
            )
        self.min_clients = min_clients
        self.num_rounds = num_rounds
        self.start_round = start_round
        self.wait_time_after_min_received = wait_time_after_min_received
        self.aggregator_id = aggregator_id
        self.persistor_id = persistor_id
        self.shareable_generator_id = shareable_generator_id
        self.train_task_name = train_task_name
        self.train_timeout = train_timeout
        self.ignore_result_error = ignore_result_error
        self.download_to_disk = download_to_disk
        self.download_to_disk_dir = download_to_disk_dir
        self.rules = ResultRules.from_args(allow_non_finite, metric_ranges)

    def _gather(
        self,
        aggregator: Aggregator,
        current_round: int,
        accepted: list[str],
        failures: dict[str, str],
        refused: dict[str, str],
        client_task: ClientTask,
    ) -> None:
        """Check one client's result and give it to the aggregator as it arrives, then drop it."""
        result, client_task.result = client_task.result, None
        client = client_task.client
        code = result.get_return_code() if result is not None else ReturnCode.EMPTY_RESULT
        if code is not ReturnCode.OK:
            reason = result.get_header(REASON_HEADER, "") if result is not None else ""
            failures[client] = f"{code.value}: {reason}"
            if not self.ignore_result_error:
                self.cancel_task(client_task.task)
            return
        try:
            self.rules.check_dxo_result(result, client, current_round)
            if not aggregator.accept(result, client, current_round):
                raise ValueError("refused by the aggregator (its reason is in the server log)")
        except ValueError as e:
            log.warning("result refused: site=%s round=%d reason=%s", client, current_round, e)
            refused[client] = str(e)
            _release(result)
            raise ResultRefused(str(e)) from e
        accepted.append(client)

    def use_job_paths(self, paths: JobPaths) -> None:
        """At job start: refuse a ``download_to_disk_dir`` outside the site's folders (see `check_download_dir`)."""
        check_download_dir(paths, self.download_to_disk, self.download_to_disk_dir)

    def run(self) -> None:
        with receiving_to_disk(self.context, self.download_to_disk, self.download_to_disk_dir) as area:
            self._run_rounds(area)

    def _run_rounds(self, area: DiskDownloadArea | None) -> None:
        aggregator = self.context.get_component(self.aggregator_id, Aggregator, key="aggregator_id")
        persistor = self.context.get_component(self.persistor_id, ModelPersistor, key="persistor_id")
        generator = self.context.get_component(
            self.shareable_generator_id, ShareableGenerator, key="shareable_generator_id"
        )
        model = persistor.load_model()
        clients = self.get_clients()
        if len(clients) < self.min_clients:
            raise RuntimeError(f"min_clients={self.min_clients} but only {len(clients)} clients run the job")
        for current_round in range(self.start_round, self.start_round + self.num_rounds):
            if self.abort_signal.is_set():
                return
            started = time.monotonic()
            self.context.report("round_started", round=current_round, total_rounds=self.num_rounds, clients=clients)
            aggregator.reset()
            accepted: list[str] = []
            failures: dict[str, str] = {}
            refused: dict[str, str] = {}
            aggregator.start_round(current_round, functools.partial(_params_of, model))  # held here anyway

            gather = functools.partial(self._gather, aggregator, current_round, accepted, failures, refused)

            data = generator.learnable_to_shareable(model)
            data.set_header(ReservedHeaderKey.CURRENT_ROUND, current_round)
            data.set_header(ReservedHeaderKey.TOTAL_ROUNDS, self.num_rounds)
            task = Task(self.train_task_name, data, timeout=self.train_timeout, result_received_cb=gather)
            self.broadcast_and_wait(
                task,
                targets=clients,
                min_responses=self.min_clients,
                wait_time_after_min_received=self.wait_time_after_min_received,
                abort_signal=self.abort_signal,
            )
            if failures and not self.ignore_result_error:
                raise RuntimeError(f"round {current_round + 1}: a client's result is an error: {failures}")
            if self.abort_signal.is_set():
                return
            if len(accepted) < self.min_clients:
                raise RuntimeError(
                    f"round {current_round + 1}: {len(accepted)} usable result(s), {self.min_clients} needed "
                    f"(min_clients); {({**failures, **refused}) or 'no reason reported'}"
                )
            model = generator.shareable_to_learnable(aggregator.aggregate(current_round), model)
            model.current_round = current_round
            persistor.save_model(with_real_tensors(model))
            self.context.report(
                "round_done",
                round=current_round,
                total_rounds=self.num_rounds,
                time_s=round(time.monotonic() - started, 3),
                metrics=dict(model.metrics or {}),
                clients=sorted(accepted),
                failed={**failures, **refused},
                refused=refused,
                **disk_figures(area, current_round),
            )


def _release(result: Shareable) -> None:
    """Let go of a refused result's downloaded files, if it has any."""
    try:
        release_values(DXO.from_shareable(result).data)
    except ValueError:
        pass


def _params_of(model: FLModel) -> dict[str, Any]:
    """The global model's params (what an aggregator that reads the global model is given)."""
    return dict(model.params or {})
