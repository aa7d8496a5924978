"""`FedAvgRecipe` and `FedOptRecipe`: server-side averaging (``engine.workflows.FedAvg`` / ``FedOpt``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.recipes import checks
from engine.recipes.recipe import PERSISTOR_ID, QUANTIZE_MODES, Recipe

AGGREGATOR_ID = "aggregator"
#: The filter that quantizes a model on its way out (``quantize``).
QUANTIZE_FILTER = "engine.filters.Quantize"
#: FedOpt's server optimizers (``engine.workflows.FedOpt``'s ``server_optimizer``).
SERVER_OPTIMIZERS = ("sgd", "momentum", "adam", "yogi", "adagrad")


class FedAvgRecipe(Recipe):
    """FedAvg: each round the server sends the global model to the clients and averages what they send back.

    Takes every argument of `Recipe` (model, train_script, num_rounds, num_clients, ...) and:

    Args:
        aggregator: A custom aggregator, a dotted path or ``{"path": ..., "args": {...}}`` (e.g.
            ``engine.aggregators.TrimmedMeanAggregator``); a weighted mean by default.
        download_to_disk: The server receives results on disk and averages one tensor at a time.
        sample_fraction: Sample this fraction of the clients each round, in (0, 1].
        sample_seed: Seed of that sampling (the same clients again on a rerun).
        metric_ranges: Metric -> ``[low, high]``; a site's value outside is dropped.
        quantize: ``"fp16"``, ``"bf16"`` or ``"int8"``: the global model and the clients' results
            cross the network quantized (``engine.filters.Quantize`` on the server's task data
            and the clients' results); None sends them exactly.
        workflow_args: Any other arg of ``engine.workflows.FedAvg`` by its name (``train_timeout``,
            ``min_clients``, ``aggregation_weights`` ...), checked against its signature by the
            validation at export.

    Example:
        >>> recipe = FedAvgRecipe(model="net.Net", model_args={"hidden": 64}, train_script="train.py",
        ...                       custom_files=["net.py"], num_rounds=2, num_clients=2)
        >>> recipe.add_server_config({"tensor_download_chunk_size": 4 * 2**20})
        >>> result = recipe.run()   # or recipe.export("jobs/my-fedavg")
    """

    default_name = "fedavg"
    recipe_name = "FedAvgRecipe"
    workflow_path = "engine.workflows.FedAvg"

    def __init__(
        self,
        *,
        aggregator: str | Mapping[str, Any] | None = None,
        download_to_disk: bool = False,
        sample_fraction: float | None = None,
        sample_seed: int | None = None,
        metric_ranges: Mapping[str, Any] | None = None,
        quantize: str | None = None,
        workflow_args: Mapping[str, Any] | None = None,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        if quantize is not None:
            mode = {"mode": checks.choice("quantize", quantize, QUANTIZE_MODES)}
            self.add_server_filter(QUANTIZE_FILTER, mode, kind="task_data")
            self.add_client_filter(QUANTIZE_FILTER, mode, kind="task_result")
        self.aggregator = None if aggregator is None else checks.component("aggregator", aggregator)
        self.download_to_disk = checks.boolean("download_to_disk", download_to_disk)
        self.sample_fraction = (
            None
            if sample_fraction is None
            else checks.number("sample_fraction", sample_fraction, low=0, high=1, low_open=True)
        )
        self.sample_seed = None if sample_seed is None else checks.positive_int("sample_seed", sample_seed, minimum=0)
        self.metric_ranges = checks.metric_ranges("metric_ranges", metric_ranges)
        self.workflow_args = checks.config_dict("workflow_args", workflow_args)
        checks.no_overlap("workflow_args", self.workflow_args, self._owned_args())

    def _owned_args(self) -> dict[str, str]:
        """Workflow args the recipe sets, with the recipe argument that sets each."""
        return {
            "num_clients": "num_clients (or sample_fraction)",
            "num_rounds": "num_rounds",
            "persistor_id": "model",
            "aggregator_id": "aggregator",
            "download_to_disk": "download_to_disk",
            "sample_fraction": "sample_fraction",
            "sample_seed": "sample_seed",
            "metric_ranges": "metric_ranges",
        }

    def _workflow_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "num_clients": self.num_clients,
            "num_rounds": self.num_rounds,
            "persistor_id": PERSISTOR_ID,
            "download_to_disk": self.download_to_disk,
        }
        if self.aggregator is not None:
            args["aggregator_id"] = AGGREGATOR_ID
        optional = {"sample_fraction": self.sample_fraction, "sample_seed": self.sample_seed}
        args.update({key: value for key, value in optional.items() if value is not None})
        if self.metric_ranges is not None:
            args["metric_ranges"] = self.metric_ranges
        return {**args, **self._algorithm_args(), **self.workflow_args}

    def _algorithm_args(self) -> dict[str, Any]:
        """Args of a subclass's workflow beyond FedAvg's."""
        return {}

    def _server_side(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        workflow = {"id": self.default_name, "path": self.workflow_path, "args": self._workflow_args()}
        components = [self.persistor()]
        if self.aggregator is not None:
            components.append({"id": AGGREGATOR_ID, **self.aggregator})
        return [workflow], components

    def _client_side(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return [self.script_executor(["*"])], []

    def _reserved_ids(self, side: str) -> set[str]:
        return {PERSISTOR_ID, AGGREGATOR_ID} if side == "server" else set()


class FedOptRecipe(FedAvgRecipe):
    """FedOpt (Reddi et al., "Adaptive Federated Optimization"): FedAvg whose server steps with an optimizer.

    Takes every argument of `FedAvgRecipe` and those of ``engine.workflows.FedOpt``; an argument
    left None is not written (the workflow's default applies).

    Args:
        server_optimizer: ``sgd``, ``momentum`` (FedAvgM), ``adam``, ``yogi`` or ``adagrad``.
        server_lr: The server's learning rate, > 0 (``sgd`` with 1.0 is FedAvg; the adaptive
            ones usually take about 0.01).
        momentum: In [0, 1), for ``momentum``.
        beta1: In [0, 1).
        beta2: In [0, 1).
        epsilon: > 0, the adaptivity ``tau``.
    """

    default_name = "fedopt"
    recipe_name = "FedOptRecipe"
    workflow_path = "engine.workflows.FedOpt"

    def __init__(
        self,
        *,
        server_optimizer: str = "adam",
        server_lr: float | None = None,
        momentum: float | None = None,
        beta1: float | None = None,
        beta2: float | None = None,
        epsilon: float | None = None,
        **fedavg: Any,
    ) -> None:
        self.optimizer_args: dict[str, Any] = {
            "server_optimizer": checks.choice("server_optimizer", server_optimizer, SERVER_OPTIMIZERS)
        }
        bounds = {
            "server_lr": (server_lr, {"low": 0, "low_open": True}),
            "momentum": (momentum, {"low": 0, "high": 1, "high_open": True}),
            "beta1": (beta1, {"low": 0, "high": 1, "high_open": True}),
            "beta2": (beta2, {"low": 0, "high": 1, "high_open": True}),
            "epsilon": (epsilon, {"low": 0, "low_open": True}),
        }
        for name, (value, limits) in bounds.items():
            if value is not None:
                self.optimizer_args[name] = checks.number(name, value, **limits)
        super().__init__(**fedavg)

    def _owned_args(self) -> dict[str, str]:
        return {**super()._owned_args(), **{name: name for name in self.optimizer_args}}

    def _algorithm_args(self) -> dict[str, Any]:
        return dict(self.optimizer_args)
