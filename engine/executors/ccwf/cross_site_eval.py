"""`CrossSiteEvalClientController`: a client's part of cross-site evaluation.

At the config task an evaluatee gets its own model ready (the ``submit_model`` task of its
trainer) and the global model client lists its persisted models. Each ``cse_eval`` task names a
model and its owner: the evaluator asks the owner for it (peer to peer; the tensors are pulled
from the owner), runs the ``validate`` task on it and returns the metrics to the server.

A site serves its models only to the evaluators the server's config names, and asks for models
only from the evaluatees and the global model client it names.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from engine.cells import Message, Reply
from engine.executors.ccwf.client_side import ClientSideController, failed, owner_among, refused
from engine.model import FLModel, ReturnCode, Shareable, carries_model, shareable_from_model
from engine.model.ccwf import CCWF_CHANNEL, EVAL_TASK, GLOBAL_MODELS_KEY, LOCAL_MODEL, MODEL_NAME_KEY, MODEL_OWNER_KEY
from engine.persistors import ModelPersistor
from engine.streaming.lazy import cleanup_lazy_refs

log = logging.getLogger(__name__)

#: Task name prefix of cross-site evaluation (the server side's).
CSE_PREFIX = "cse"
#: The name a global model client gives the model its persistor holds.
GLOBAL_MODEL = "global"
#: Peer topic (after ``<prefix>_``): "send me your model".
GET_MODEL = "get_model"


class CrossSiteEvalClientController(ClientSideController):
    """Evaluates the other sites' models and serves its own; route ``cse_*`` to it.

    Args:
        submit_model_task_name: The task whose result is this site's own model.
        validation_task_name: The task that validates a model and returns metrics.
        persistor_id: Component holding the global model (on the global model client).
        get_model_timeout: Seconds the owner of a model has to answer a request for it (the
            tensors are pulled afterwards, each chunk bounded by ``streaming_per_request_timeout``).
        task_name_prefix: Prefix of the task names (``cse``).
    """

    def __init__(
        self,
        submit_model_task_name: str = "submit_model",
        validation_task_name: str = "validate",
        persistor_id: str = "persistor",
        get_model_timeout: float = 10.0,
        task_name_prefix: str = CSE_PREFIX,
    ) -> None:
        super().__init__(task_name_prefix)
        if get_model_timeout <= 0:
            raise ValueError(f"get_model_timeout: expected seconds > 0, got {get_model_timeout}")
        self.submit_model_task_name = submit_model_task_name
        self.validation_task_name = validation_task_name
        self.persistor_id = persistor_id
        self.get_model_timeout = get_model_timeout
        self._models: dict[str, Shareable] = {}
        self.evaluators: list[str] = []
        self.evaluatees: list[str] = []
        self.global_model_client = ""

    def configure(self, config: dict[str, Any]) -> Shareable | None:
        reply = Shareable()
        self.evaluators = [str(site) for site in config.get("evaluators") or []]
        self.evaluatees = [str(site) for site in config.get("evaluatees") or []]
        self.global_model_client = str(config.get("global_model_client") or "")
        if self.site in self.evaluatees:
            result = self.context.run_task(  # type: ignore[misc]
                self.submit_model_task_name, shareable_from_model(FLModel(params={})), self.stopped
            )
            if result.get_return_code() is not ReturnCode.OK or not carries_model(result):
                raise RuntimeError(
                    f"{self.submit_model_task_name} gave no model: {result.get_return_code().value} "
                    f"{result.get_header('reason') or ''}".rstrip()
                )
            self._models[LOCAL_MODEL] = result
        if config.get("global_model_client") == self.site:
            persistor = self.context.get_component(self.persistor_id, "persistor_id")
            if not isinstance(persistor, ModelPersistor):
                raise ValueError(
                    f"persistor_id: {self.persistor_id!r} is a {type(persistor).__name__}, not a persistor"
                )
            self._models[GLOBAL_MODEL] = shareable_from_model(persistor.load_model())
            reply[GLOBAL_MODELS_KEY] = [GLOBAL_MODEL]
        self.cell.register_handler(CCWF_CHANNEL, f"{self.task_name_prefix}_{GET_MODEL}", self._on_get_model)
        self.update_status(phase="configured")
        return reply

    def handle_task(self, name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        if name != EVAL_TASK:
            return super().handle_task(name, shareable, abort_signal)
        owner, model_name = str(shareable[MODEL_OWNER_KEY]), str(shareable[MODEL_NAME_KEY])
        holders = self.evaluatees if model_name == LOCAL_MODEL else [self.global_model_client]
        if not owner or owner not in holders:
            return failed(
                ReturnCode.BAD_TASK_DATA,
                f"{owner} holds no model {model_name!r} to evaluate in this workflow "
                f"(evaluatees: {', '.join(self.evaluatees) or 'none'}; "
                f"global_model_client: {self.global_model_client or 'none'})",
            )
        self.update_status(phase=f"evaluating {model_name} of {owner}")
        try:
            model = self._get_model(owner, model_name)
        except Exception as e:
            return failed(ReturnCode.EXECUTION_EXCEPTION, f"could not get model {model_name!r} of {owner}: {e}")
        try:
            return self.context.run_task(self.validation_task_name, Shareable(model), abort_signal)  # type: ignore[misc]
        finally:
            if owner != self.site:
                cleanup_lazy_refs(model)

    def finalize(self) -> None:
        self._models.clear()
        super().finalize()

    def _get_model(self, owner: str, model_name: str) -> Shareable:
        if owner == self.site:
            if model_name not in self._models:
                raise KeyError(f"{self.site} has no model {model_name!r}")
            return self._models[model_name]
        reply = self.cell.request(
            owner,
            CCWF_CHANNEL,
            f"{self.task_name_prefix}_{GET_MODEL}",
            {MODEL_NAME_KEY: model_name},
            timeout_s=self.get_model_timeout,
            stop=self.stopped,
        )
        model = self.codec.decode(list(reply.frames), sender=reply.source, stop=self.stopped)
        if not isinstance(model, Shareable):
            raise TypeError(f"expected a Shareable, got {type(model).__name__}")
        return model

    def _on_get_model(self, message: Message) -> Reply:
        """Serve a model of this site: only to the evaluators the config names."""
        if owner_among(message.source, self.evaluators) is None:
            evaluators = ", ".join(self.evaluators) or "none"
            return refused(message, f"{message.source} is not one of the evaluators ({evaluators}); no model for it")
        name = str(message.header.get(MODEL_NAME_KEY))
        model = self._models.get(name)
        if model is None:
            return refused(message, f"{self.site} has no model {name!r} (it has: {', '.join(self._models) or 'none'})")
        return Reply(header={}, frames=self.codec.encode(model, receivers=[message.source]))
