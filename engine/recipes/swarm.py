"""`SwarmRecipe` and `CrossSiteEvalRecipe`: client-controlled workflows (``engine.workflows.ccwf``).

The keys and their defaults are those of ``engine/templates/swarm`` and ``engine/templates/cse``
(``flengine new --template swarm|cse``), which explain each one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.recipes import checks
from engine.recipes.recipe import PERSISTOR_ID, QUANTIZE_MODES, Recipe

AGGREGATOR_ID = "aggregator"
SHAREABLE_GENERATOR_ID = "shareable_generator"
DEFAULT_AGGREGATOR = {"path": "engine.aggregators.DXOAggregator", "args": {"expected_data_kind": "WEIGHTS"}}
#: The server side's args as the swarm template sets them.
SWARM_SERVER_DEFAULTS = {"start_task_timeout": 300, "progress_timeout": 7200}
#: The client side's args as the swarm template sets them (min_responses_required: every client).
SWARM_CLIENT_DEFAULTS = {
    "learn_task_timeout": 3600,
    "learn_task_ack_timeout": 300,
    "final_result_ack_timeout": 300,
    "request_to_submit_result_msg_timeout": 10.0,
    "request_to_submit_result_interval": 2.0,
    "request_to_submit_result_max_wait": 600.0,
    "max_concurrent_submissions": 1,
    "wait_time_after_min_resps_received": 120,
}
#: The script's tasks in cross-site evaluation.
VALIDATE_TASK, SUBMIT_MODEL_TASK = "validate", "submit_model"
LEARN_TASK = "train"
_NONE = "@none"


class SwarmRecipe(Recipe):
    """Swarm learning: the clients train, and aggregate among themselves; the server only coordinates.

    Takes every argument of `Recipe` and:

    Args:
        aggregator: The clients' aggregator, a dotted path or ``{"path": ..., "args": {...}}``;
            ``engine.aggregators.DXOAggregator`` of WEIGHTS by default.
        download_to_disk: A client receives models on disk and aggregates one tensor at a time.
        metric_ranges: Metric -> ``[low, high]``; a trainer's value outside is dropped.
        quantize: ``"fp16"``, ``"bf16"`` or ``"int8"``: round models and results cross the
            network quantized (the executor's ``quantize``); None sends them exactly.
        min_responses_required: Results a round needs; every client (``num_clients``) by default.
        server_args: Other args of ``engine.workflows.ccwf.SwarmServerController``
            (``start_task_timeout``, ``progress_timeout``, ``aggr_clients``, ``train_clients``, ...).
        client_args: Other args of ``engine.executors.ccwf.SwarmClientController``
            (``learn_task_timeout``, ``max_concurrent_submissions``, ...).
    """

    default_name = "swarm"
    recipe_name = "SwarmRecipe"

    def __init__(
        self,
        *,
        aggregator: str | Mapping[str, Any] | None = None,
        download_to_disk: bool = False,
        metric_ranges: Mapping[str, Any] | None = None,
        quantize: str | None = None,
        min_responses_required: int | None = None,
        server_args: Mapping[str, Any] | None = None,
        client_args: Mapping[str, Any] | None = None,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.aggregator = DEFAULT_AGGREGATOR if aggregator is None else checks.component("aggregator", aggregator)
        self.download_to_disk = checks.boolean("download_to_disk", download_to_disk)
        self.metric_ranges = checks.metric_ranges("metric_ranges", metric_ranges)
        self.quantize = None if quantize is None else checks.choice("quantize", quantize, QUANTIZE_MODES)
        self.min_responses_required = (
            self.num_clients
            if min_responses_required is None
            else checks.positive_int("min_responses_required", min_responses_required)
        )
        self.server_args = checks.config_dict("server_args", server_args)
        checks.no_overlap("server_args", self.server_args, {"num_rounds": "num_rounds"})
        self.client_args = checks.config_dict("client_args", client_args)
        owned = {
            "learn_task_name": "train_script",
            "persistor_id": "model",
            "shareable_generator_id": "aggregator",
            "aggregator_id": "aggregator",
            "download_to_disk": "download_to_disk",
            "metric_ranges": "metric_ranges",
            "quantize": "quantize",
            "min_responses_required": "min_responses_required",
        }
        checks.no_overlap("client_args", self.client_args, owned)

    def _trains(self) -> bool:
        return True

    def _swarm_workflow(self) -> dict[str, Any]:
        args = {"num_rounds": self.num_rounds, **SWARM_SERVER_DEFAULTS, **self.server_args}
        return {"id": "swarm_controller", "path": "engine.workflows.ccwf.SwarmServerController", "args": args}

    def _swarm_executor(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "learn_task_name": LEARN_TASK,
            "persistor_id": PERSISTOR_ID,
            "shareable_generator_id": SHAREABLE_GENERATOR_ID,
            "aggregator_id": AGGREGATOR_ID,
            "min_responses_required": self.min_responses_required,
            "download_to_disk": self.download_to_disk,
            **SWARM_CLIENT_DEFAULTS,
        }
        if self.metric_ranges is not None:
            args["metric_ranges"] = self.metric_ranges
        if self.quantize is not None:
            args["quantize"] = self.quantize
        args.update(self.client_args)
        return {"tasks": ["swarm_*"], "executor": {"path": "engine.executors.ccwf.SwarmClientController", "args": args}}

    def _swarm_components(self) -> list[dict[str, Any]]:
        return [
            {"id": AGGREGATOR_ID, **self.aggregator},
            {"id": SHAREABLE_GENERATOR_ID, "path": "engine.workflows.FullModelShareableGenerator", "args": {}},
        ]

    def _server_side(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return [self._swarm_workflow()], []

    def _client_side(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        executors = [self.script_executor([LEARN_TASK]), self._swarm_executor()]
        return executors, [self.persistor(), *self._swarm_components()]

    def _reserved_ids(self, side: str) -> set[str]:
        return {PERSISTOR_ID, AGGREGATOR_ID, SHAREABLE_GENERATOR_ID} if side == "client" else set()


class CrossSiteEvalRecipe(SwarmRecipe):
    """Swarm learning for ``num_rounds``, then cross-site evaluation: every site validates every model.

    ``num_rounds=0`` evaluates without training: the starting model (``initial_checkpoint`` or
    a model instance's weights) as the global model, and each site's own model from its
    script's ``submit_model`` task. The script must answer ``validate`` (metrics of the received
    model) and ``submit_model`` (its own model), as the digits example's ``train.py`` does.
    Takes every argument of `SwarmRecipe` and:

    Args:
        eval_task_timeout: Seconds one evaluator has to get one model and validate it.
        eval_metric_ranges: Metric -> ``[low, high]``; an evaluator's value outside is left out.
        evaluators: Sites that validate; every client by default.
        evaluatees: Sites whose own models are validated; every client by default, ``"@none"``
            for none (the global model only).
        global_model_client: The site whose persistor's model is the global one (the first by
            default); ``"@none"`` for no global model.
        cse_args: Other args of ``engine.workflows.ccwf.CrossSiteEvalServerController``.
    """

    default_name = "cse"
    recipe_name = "CrossSiteEvalRecipe"

    def __init__(
        self,
        *,
        eval_task_timeout: float = 1200,
        eval_metric_ranges: Mapping[str, Any] | None = None,
        evaluators: Sequence[str] | None = None,
        evaluatees: Sequence[str] | str | None = None,
        global_model_client: str | None = None,
        cse_args: Mapping[str, Any] | None = None,
        **swarm: Any,
    ) -> None:
        super().__init__(**swarm)
        args: dict[str, Any] = {
            "eval_task_timeout": checks.number("eval_task_timeout", eval_task_timeout, low=0, low_open=True)
        }
        ranges = checks.metric_ranges("eval_metric_ranges", eval_metric_ranges)
        if ranges is not None:
            args["metric_ranges"] = ranges
        if evaluators is not None:
            args["evaluators"] = checks.site_names("evaluators", evaluators)
        if evaluatees is not None:
            args["evaluatees"] = _NONE if evaluatees == _NONE else checks.site_names("evaluatees", evaluatees)
        if global_model_client is not None:
            args["global_model_client"] = checks.text("global_model_client", global_model_client)
        if args.get("evaluatees") == _NONE and args.get("global_model_client") == _NONE:
            raise ValueError("evaluatees and global_model_client are both '@none': there would be nothing to evaluate")
        extra = checks.config_dict("cse_args", cse_args)
        owned = {key: key for key in ("eval_task_timeout", "evaluators", "evaluatees", "global_model_client")}
        checks.no_overlap("cse_args", extra, {**owned, "metric_ranges": "eval_metric_ranges"})
        self.cse_args = {**args, **extra}

    def _min_rounds(self) -> int:
        return 0

    def _trains(self) -> bool:
        return self.num_rounds > 0

    def _server_side(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        cse = {
            "id": "cross_site_eval",
            "path": "engine.workflows.ccwf.CrossSiteEvalServerController",
            "args": self.cse_args,
        }
        return ([self._swarm_workflow()] if self._trains() else []) + [cse], []

    def _client_side(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        tasks = [LEARN_TASK, VALIDATE_TASK, SUBMIT_MODEL_TASK] if self._trains() else [VALIDATE_TASK, SUBMIT_MODEL_TASK]
        cse = {
            "tasks": ["cse_*"],
            "executor": {
                "path": "engine.executors.ccwf.CrossSiteEvalClientController",
                "args": {
                    "submit_model_task_name": SUBMIT_MODEL_TASK,
                    "validation_task_name": VALIDATE_TASK,
                    "persistor_id": PERSISTOR_ID,
                },
            },
        }
        if not self._trains():
            return [self.script_executor(tasks), cse], [self.persistor()]
        executors = [self.script_executor(tasks), self._swarm_executor(), cse]
        return executors, [self.persistor(), *self._swarm_components()]
