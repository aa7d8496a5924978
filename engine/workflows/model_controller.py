"""`ModelController`: a Controller that speaks `FLModel` (load, send and wait, save, sample)."""

from __future__ import annotations

import logging
import random
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

from engine.aggregators.refusals import record_refusal
from engine.aggregators.weighted import release_values
from engine.controller import ClientTask, Controller, Task, TaskCompletionStatus
from engine.controller.queue import RESULT_RECEIVER_PROP
from engine.errors import ResultRefused
from engine.model import (
    FLModel,
    ReservedHeaderKey,
    ReturnCode,
    Shareable,
    model_from_shareable,
    shareable_from_model,
    shown_round,
)
from engine.persistors import ModelPersistor
from engine.workflows.downloads import with_real_tensors

log = logging.getLogger(__name__)

#: Called with each client's result model as it arrives: ``callback(model, client)``.
ResultCallback = Callable[[FLModel, str], None]
#: Header of a failed result that says why (set by executors).
REASON_HEADER = "reason"


class ModelController(Controller):
    """Base of model-based workflows: they implement `run`.

    Round-based algorithms (`FedAvg`, `FedOpt`, `ScatterAndGather`) do not write `run`
    themselves: they fill in the hooks of `engine.workflows.round_loop.RoundLoop`, which is
    written on these helpers. A workflow of another shape (a single task, cross-site
    evaluation) subclasses this class directly.

    Args:
        persistor_id: Id of the `ModelPersistor` component that loads and saves the model.
    """

    def __init__(self, persistor_id: str = "persistor") -> None:
        super().__init__()
        self.persistor_id = persistor_id
        self.failures: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        #: Clients of the last task that died holding it (even if they are back by now).
        self.died: set[str] = set()

    @abstractmethod
    def run(self) -> None:
        """The workflow."""

    @property
    def persistor(self) -> ModelPersistor:
        return self.context.get_component(self.persistor_id, ModelPersistor, key="persistor_id")

    def load_model(self) -> FLModel:
        """The current global model, from the persistor (the starting one until a round saved another)."""
        return self.persistor.load_model()

    def save_model(self, model: FLModel) -> None:
        """Checkpoint ``model`` through the persistor (lazy params are read first)."""
        self.persistor.save_model(with_real_tensors(model))

    def sample_clients(self, num_clients: int | None = None, rng: random.Random | None = None) -> list[str]:
        """``num_clients`` clients of the job chosen at random (all of them, in order, by default).

        Args:
            num_clients: How many; None or at least the job's clients: all of them.
            rng: The random source (seed one for sampling that repeats); the module's by default.
        """
        clients = self.get_clients()
        if num_clients is None or num_clients >= len(clients):
            if num_clients is not None and num_clients > len(clients):
                log.warning("num_clients=%d but only %d clients run the job; using all", num_clients, len(clients))
            return list(clients)
        return sorted((rng or random).sample(list(clients), num_clients))

    def send_model_and_wait(
        self,
        targets: list[str] | None = None,
        data: FLModel | None = None,
        task_name: str = "train",
        timeout: float = 0.0,
        wait_time_after_min_received: float = 0.0,
        min_responses: int | None = None,
        callback: ResultCallback | None = None,
        release_after_send: bool = False,
    ) -> list[FLModel]:
        """Send ``data`` to ``targets`` as task ``task_name`` and wait for their results.

        Args:
            targets: Client names (all clients when None).
            data: The model to send.
            task_name: The task's name (executors are chosen by it).
            timeout: Seconds the task may take in all (0 = no limit).
            wait_time_after_min_received: Seconds to wait for more results once
                ``min_responses`` are in.
            min_responses: Results needed; all targets when None.
            callback: Called with each successful result as it arrives; when given, the results
                are not kept (InTime processing) and the returned list is empty. It refuses a
                result by raising `ResultRefused`; anything else it raises is a bug in it (the
                result fails, logged with the traceback; see `engine.aggregators.refusals`).
            release_after_send: Drop the task's reference to ``data`` once every target has
                been sent it, so a large model is not kept in memory while the clients train
                (the caller must hold no reference either, to free it).

        Returns:
            The successful results (``meta["client_name"]`` says whose), unless a callback took them.
            Failed results are recorded in `failures` (client -> reason): those refused by a check
            (or the callback's `ResultRefused`) also in `refused`, error results (a non-OK return
            code) in `errors`.
        """
        current_round, total_rounds = (data.current_round, data.total_rounds) if data else (None, None)
        handed = [shareable_from_model(data or FLModel())]
        del data  # from here on only the task holds the model: this frame keeps no reference
        return self.send_and_gather(
            handed.pop(),
            targets=targets,
            task_name=task_name,
            current_round=current_round,
            total_rounds=total_rounds,
            timeout=timeout,
            wait_time_after_min_received=wait_time_after_min_received,
            min_responses=min_responses,
            callback=callback,
            release_after_send=release_after_send,
        )

    def send_and_gather(
        self,
        shareable: Shareable,
        *,
        targets: list[str] | None = None,
        task_name: str = "train",
        current_round: int | None = None,
        total_rounds: int | None = None,
        timeout: float = 0.0,
        wait_time_after_min_received: float = 0.0,
        min_responses: int | None = None,
        callback: ResultCallback | None = None,
        release_after_send: bool = False,
        cancel_on_error: bool = False,
        result_receiver: Callable[[Shareable, str], Any] | None = None,
    ) -> list[FLModel]:
        """`send_model_and_wait` for task data already in a `Shareable` (a DXO, say): results come back as `FLModel`.

        Args:
            shareable: The task data; the task holds it from here on (with ``release_after_send``,
                until every target has been sent it).
            current_round: Set as the task's ``current_round`` header; a result of another round is refused.
            total_rounds: Set as the task's ``total_rounds`` header.
            cancel_on_error: Cancel the task at once when a client's result is an error (a
                non-OK return code); such results are in `errors` as well as `failures`.
            result_receiver: Asked before each result's tensors are pulled (see
                `engine.controller.queue.RESULT_RECEIVER_PROP`): the round loop's folding into the sum.

        The other args and the return value are `send_model_and_wait`'s.
        """
        targets = list(targets) if targets is not None else self.get_clients()
        shareable.set_header(ReservedHeaderKey.TASK_NAME, task_name)
        if current_round is not None:
            shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, current_round)
        if total_rounds is not None:
            shareable.set_header(ReservedHeaderKey.TOTAL_ROUNDS, total_rounds)
        results: list[FLModel] = []
        self.failures = {}
        self.refused = {}
        self.errors = {}
        self.died = set()

        def refuse(client: str, reason: str) -> None:
            log.warning("result refused: site=%s round=%s reason=%s", client, shown_round(current_round), reason)
            self.failures[client] = reason
            self.refused[client] = reason

        def on_result(client_task: ClientTask) -> None:
            result = client_task.result
            client_task.result = None  # InTime: the task keeps no client's tensors
            if result is None or result.get_return_code() is not ReturnCode.OK:  # the site says it failed
                reason = str(self._result_model(result, client_task.client, current_round))
                self.failures[client_task.client] = reason
                self.errors[client_task.client] = reason
                if cancel_on_error:
                    self.cancel_task(client_task.task)
                raise ResultRefused(reason)
            model_or_reason = self._result_model(result, client_task.client, current_round)
            if isinstance(model_or_reason, str):
                refuse(client_task.client, model_or_reason)
                raise ResultRefused(model_or_reason)
            if callback is not None:
                try:
                    callback(model_or_reason, client_task.client)
                except Exception as e:
                    # The task queue logs a bug's traceback (it sees the exception raised again).
                    record_refusal(
                        e, client_task.client, current_round, self.failures, self.refused, with_traceback=False
                    )
                    release_values(model_or_reason.params or {})  # its files on disk, if any
                    raise
            else:
                results.append(model_or_reason)

        def release_when_all_sent(client_task: ClientTask) -> None:
            task = client_task.task  # each target's copy is made before this runs
            if task.targets and all(target in task.last_client_task_map for target in task.targets):
                task.data = Shareable()

        task = Task(
            task_name,
            shareable,
            props={RESULT_RECEIVER_PROP: result_receiver} if result_receiver is not None else None,
            timeout=timeout,
            result_received_cb=on_result,
            after_task_sent_cb=release_when_all_sent if release_after_send else None,
        )
        del shareable
        self.broadcast_and_wait(
            task,
            targets=targets,
            min_responses=len(targets) if min_responses is None else min_responses,
            wait_time_after_min_received=wait_time_after_min_received,
            abort_signal=self.abort_signal,
        )
        for client_task in task.client_tasks:
            status = client_task.status
            if status is TaskCompletionStatus.CLIENT_DEAD:
                self.died.add(client_task.client)
            if client_task.client not in self.failures and status not in (None, TaskCompletionStatus.OK):
                reason = client_task.reason
                self.failures[client_task.client] = f"{status.value}: {reason}" if reason else status.value
        answered = {ct.client for ct in task.client_tasks}
        for client in targets:
            if client not in answered and client not in self.failures:
                self.failures[client] = "no result"
        return results

    @staticmethod
    def _result_model(result: Shareable | None, client: str, current_round: int | None) -> FLModel | str:
        """The result's model, or why it cannot be used."""
        if result is None:
            return "no result"
        code = result.get_return_code()
        if code is not ReturnCode.OK:
            return f"{code.value}: {result.get_header(REASON_HEADER, 'no reason given')}"
        result_round = result.get_header(ReservedHeaderKey.CURRENT_ROUND)
        if current_round is not None and result_round is not None and result_round != current_round:
            return f"result of round {shown_round(result_round)} arrived in round {shown_round(current_round)}"
        try:
            model = model_from_shareable(result)
        except ValueError as e:
            return str(e)
        model.meta["client_name"] = client
        return model
