"""Recipes write ordinary job folders: valid as `flengine validate` sees them, holding exactly what they were given."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cli import main
from engine.config import job_code_on_path, load_config, validate_job
from engine.errors import ConfigError, UsageError
from engine.persistors import PTFileModelPersistor
from engine.recipes import CrossSiteEvalRecipe, FedAvgRecipe, FedOptRecipe, SimEnv, SwarmRecipe
from engine.recipes.recipe import CLIENT_CONFIG, META, SERVER_CONFIG

TEMPLATE = Path(__file__).resolve().parents[3] / "engine" / "examples"  # the example's train.py
CUSTOM = Path(__file__).resolve().parent / "custom_model"  # a model class of the job's own: net.py
CUSTOM_FILES = [CUSTOM / "net.py"]
DIGITS = {
    "model": "net.Net",
    "model_args": {"hidden": 16},
    "train_script": TEMPLATE / "train.py",
    "train_args": "--epochs 1 --hidden 16",
    "custom_files": CUSTOM_FILES,
    "num_rounds": 2,
    "num_clients": 2,
}
HOSTILE = ['a"b', "${HOME}", "${?HOME}", "x\ny", "back\\slash", "a.b", "# c", 'include "x"', "ünï", "true"]


def written(folder: Path) -> dict[str, dict[str, Any]]:
    """The three configs of a job folder, read back through engine.config."""
    return {
        path: load_config(folder / path, path, folder, environment=False).data
        for path in (META, SERVER_CONFIG, CLIENT_CONFIG)
    }


RECIPES = {
    "fedavg": lambda **kw: FedAvgRecipe(**DIGITS, **kw),
    "fedavg-options": lambda **kw: FedAvgRecipe(
        **DIGITS,
        aggregator={"path": "engine.aggregators.TrimmedMeanAggregator", "args": {"trim_fraction": 0.2}},
        download_to_disk=True,
        sample_fraction=0.5,
        sample_seed=3,
        metric_ranges={"global_accuracy": [0, 1]},
        key_metric="global_accuracy",
        workflow_args={"train_timeout": 60.0},
        **kw,
    ),
    "fedavg-quantized": lambda **kw: FedAvgRecipe(**DIGITS, quantize="int8", **kw),
    "swarm": lambda **kw: SwarmRecipe(**DIGITS, download_to_disk=True, server_args={"progress_timeout": 600}, **kw),
    "swarm-quantized": lambda **kw: SwarmRecipe(**DIGITS, quantize="bf16", **kw),
    "cse": lambda **kw: CrossSiteEvalRecipe(**DIGITS, eval_metric_ranges={"accuracy": [0, 1]}, **kw),
    "cse-only": lambda **kw: CrossSiteEvalRecipe(**{**DIGITS, "num_rounds": 0}, evaluatees="@none", **kw),
}


@pytest.mark.parametrize("make", list(RECIPES.values()), ids=list(RECIPES))
def test_an_exported_job_validates_and_reads_back_as_the_recipe_holds_it(tmp_path: Path, make) -> None:
    recipe = make()
    recipe.add_server_config({"tensor_download_chunk_size": 1048576, "streaming_per_request_timeout": 30})
    recipe.add_client_config({"streaming_max_requests_in_flight": 2, "cell": {"heartbeat_interval_s": 5}})

    folder = recipe.export(tmp_path / "job")

    assert validate_job(folder) == []
    assert main(["validate", str(folder)]) == 0
    assert written(folder) == recipe.configs()
    assert sorted(
        p.relative_to(folder / "app" / "custom").as_posix() for p in (folder / "app" / "custom").rglob("*.*")
    ) == ["net.py", "train.py"]
    assert (folder / "app" / "custom" / "train.py").read_bytes() == (TEMPLATE / "train.py").read_bytes()


def test_fedavg_writes_each_argument_at_its_key(tmp_path: Path) -> None:
    recipe = RECIPES["fedavg-options"]()

    server = written(recipe.export(tmp_path / "job"))[SERVER_CONFIG]

    assert server["workflows"] == [
        {
            "id": "fedavg",
            "path": "engine.workflows.FedAvg",
            "args": {
                "num_clients": 2,
                "num_rounds": 2,
                "persistor_id": "persistor",
                "download_to_disk": True,
                "aggregator_id": "aggregator",
                "sample_fraction": 0.5,
                "sample_seed": 3,
                "metric_ranges": {"global_accuracy": [0, 1]},
                "train_timeout": 60.0,
            },
        }
    ]
    assert server["components"] == [
        {
            "id": "persistor",
            "path": "engine.persistors.PTFileModelPersistor",
            "args": {"model": {"path": "net.Net", "args": {"hidden": 16}}, "key_metric": "global_accuracy"},
        },
        {"id": "aggregator", "path": "engine.aggregators.TrimmedMeanAggregator", "args": {"trim_fraction": 0.2}},
    ]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_string_round_trips_literally_through_a_valid_job(tmp_path: Path, text: str) -> None:
    as_key = not set(text) & set('"\\\n')  # a key with a quote, backslash or line break is refused (below)
    recipe = FedAvgRecipe(**DIGITS, key_metric=text, metric_ranges={text if as_key else "m": [0, 1]})
    if not as_key:  # a key_metric no range can be declared for is refused: one site could pick the best model
        with pytest.raises(ConfigError, match=r"key_metric .* has no range"):
            recipe.export(tmp_path / "refused")
        folder = recipe.export(tmp_path / "job", validate=False)
    else:
        folder = recipe.export(tmp_path / "job")

    server = written(folder)[SERVER_CONFIG]
    assert server["workflows"][0]["args"]["metric_ranges"] == {text if as_key else "m": [0, 1]}
    assert server["components"][0]["args"]["key_metric"] == text


@pytest.mark.parametrize("key", ['a"b', "back\\slash", "x\ny", ""])
def test_a_key_the_config_cannot_carry_is_refused_when_the_recipe_is_built(key: str) -> None:
    with pytest.raises(ValueError, match=r"metric_ranges: (the key .* holds a quote|an empty key)"):
        FedAvgRecipe(**DIGITS, metric_ranges={key: [0, 1]})


def test_train_args_as_a_list_are_quoted_for_the_executor(tmp_path: Path) -> None:
    arguments = ["--name", "two words", "--quote", 'a"b', "--dollar", "${X}"]
    recipe = FedAvgRecipe(**{**DIGITS, "train_args": arguments})

    executor = written(recipe.export(tmp_path / "job", validate=False))[CLIENT_CONFIG]["executors"][0]["executor"]

    assert shlex.split(executor["args"]["task_script_args"]) == arguments


def test_fedopt_writes_the_agreed_keys(tmp_path: Path) -> None:
    recipe = FedOptRecipe(**DIGITS, server_optimizer="yogi", server_lr=0.01, beta1=0.9, beta2=0.99, epsilon=1e-3)

    args = written(recipe.export(tmp_path / "job", validate=False))[SERVER_CONFIG]["workflows"][0]

    assert args["path"] == "engine.workflows.FedOpt"
    assert args["args"] == {
        "num_clients": 2,
        "num_rounds": 2,
        "persistor_id": "persistor",
        "download_to_disk": False,
        "server_optimizer": "yogi",
        "server_lr": 0.01,
        "beta1": 0.9,
        "beta2": 0.99,
        "epsilon": 1e-3,
    }


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "yogi", "adagrad"])
def test_a_fedopt_job_validates(tmp_path: Path, optimizer: str) -> None:
    recipe = FedOptRecipe(**DIGITS, server_optimizer=optimizer, server_lr=0.5, momentum=0.5)

    assert validate_job(recipe.export(tmp_path / "job")) == []


def test_a_model_instance_starts_the_job_from_its_weights(tmp_path: Path) -> None:
    with job_code_on_path(CUSTOM):
        from net import Net

        torch.manual_seed(7)
        model = Net(hidden=16)
    recipe = FedAvgRecipe(**{**DIGITS, "model": model})

    folder = recipe.export(tmp_path / "job")

    persistor_args = written(folder)[SERVER_CONFIG]["components"][0]["args"]
    assert persistor_args == {
        "model": {"path": "net.Net", "args": {"hidden": 16}},
        "source_ckpt_file_full_name": "initial_model.safetensors",
    }
    persistor = PTFileModelPersistor(
        Net(hidden=16), source_ckpt_file_full_name=str(folder / "app" / persistor_args["source_ckpt_file_full_name"])
    )
    loaded = persistor.load_model().params
    assert set(loaded) == set(model.state_dict())
    assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())
    assert load_file(folder / "app" / "initial_model.safetensors").keys() == model.state_dict().keys()


def test_an_existing_folder_is_kept_unless_overwrite_and_only_a_job_is_overwritten(tmp_path: Path) -> None:
    recipe = FedAvgRecipe(**DIGITS)
    job = recipe.export(tmp_path / "job")
    (job / "stale.txt").write_text("old")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep")

    with pytest.raises(UsageError, match=r"job: already exists and is a folder that is not empty; .*overwrite=True"):
        recipe.export(job)
    recipe.export(job, overwrite=True)
    with pytest.raises(UsageError, match="replaces only a job folder"):
        recipe.export(other, overwrite=True)

    assert not (job / "stale.txt").exists()
    assert validate_job(job) == []
    assert (other / "mine.txt").read_text() == "keep"


def test_a_job_the_engine_refuses_raises_its_problems(tmp_path: Path) -> None:
    recipe = FedAvgRecipe(**{**DIGITS, "model_args": {"hiden": 16}})

    with pytest.raises(ConfigError, match=r"model.args.*hiden"):
        recipe.export(tmp_path / "job")


def bad(**changes: Any) -> dict[str, Any]:
    return {**DIGITS, **changes}


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: FedAvgRecipe(**bad(num_rounds=0)), ValueError, "num_rounds: expected an integer >= 1, got 0"),
        (lambda: FedAvgRecipe(**bad(num_rounds="2")), TypeError, "num_rounds: expected an integer"),
        (lambda: FedAvgRecipe(**bad(num_clients=True)), TypeError, "num_clients: expected an integer"),
        (lambda: FedAvgRecipe(**bad(train_script="nope.py")), ValueError, "train_script: no such file 'nope.py'"),
        (lambda: FedAvgRecipe(**bad(train_script=CUSTOM)), ValueError, "train_script: .* is a folder"),
        (lambda: FedAvgRecipe(**bad(custom_files=["missing"])), ValueError, r"custom_files\[0\]: no such file"),
        (lambda: FedAvgRecipe(**bad(custom_files="net.py")), TypeError, "custom_files: expected a list"),
        (
            lambda: FedAvgRecipe(**bad(custom_files=[TEMPLATE / "train.py"])),
            ValueError,
            r"custom_files\[0\]: .* the name 'train.py' of train_script",
        ),
        (lambda: FedAvgRecipe(**bad(model="Net")), ValueError, "model: expected a dotted path"),
        (
            lambda: FedAvgRecipe(**bad(model=3)),
            TypeError,
            "model: expected a dotted path 'module.Class' or a torch.nn.Module",
        ),
        (lambda: FedAvgRecipe(**bad(model_args=[1])), TypeError, "model_args: expected a dict"),
        (
            lambda: FedAvgRecipe(**bad(model_args={"x": float("nan")})),
            ValueError,
            r"model_args\['x'\]: nan cannot be written",
        ),
        (lambda: FedAvgRecipe(**bad(train_args="--name 'open")), ValueError, "train_args: .* cannot be split"),
        (lambda: FedAvgRecipe(**bad(train_args=3)), TypeError, "train_args: expected a string"),
        (lambda: FedAvgRecipe(**bad(name="../up")), ValueError, "name: expected a plain job name"),
        (lambda: FedAvgRecipe(**bad(execution_mode="thread")), ValueError, "execution_mode: expected one of"),
        (lambda: FedAvgRecipe(**bad(key_metric="")), ValueError, "key_metric: expected a non-empty string"),
        (
            lambda: FedAvgRecipe(**DIGITS, sample_fraction=0),
            ValueError,
            r"sample_fraction: expected a number in \(0, 1\]",
        ),
        (lambda: FedAvgRecipe(**DIGITS, sample_fraction=1.5), ValueError, "sample_fraction"),
        (lambda: FedAvgRecipe(**DIGITS, download_to_disk="yes"), TypeError, "download_to_disk: expected True or False"),
        (lambda: FedAvgRecipe(**DIGITS, aggregator="Trimmed"), ValueError, "aggregator: expected a dotted path"),
        (
            lambda: FedAvgRecipe(**DIGITS, aggregator={"path": "a.B", "arg": {}}),
            ValueError,
            "aggregator: expected a dotted path or",
        ),
        (
            lambda: FedAvgRecipe(**DIGITS, metric_ranges={"acc": [1, 0]}),
            ValueError,
            r"metric_ranges\['acc'\]: low 1 is above high 0",
        ),
        (
            lambda: FedAvgRecipe(**DIGITS, metric_ranges={"acc": [0]}),
            ValueError,
            r"metric_ranges\['acc'\]: expected \[low, high\]",
        ),
        (
            lambda: FedAvgRecipe(**DIGITS, workflow_args={"num_rounds": 3}),
            ValueError,
            "workflow_args: 'num_rounds' is set by the recipe; use its argument num_rounds",
        ),
        (
            lambda: FedAvgRecipe(**DIGITS, initial_checkpoint="none.safetensors"),
            ValueError,
            "initial_checkpoint: no such file",
        ),
        (
            lambda: FedOptRecipe(**DIGITS, server_optimizer="rmsprop"),
            ValueError,
            "server_optimizer: expected one of 'sgd', 'momentum', 'adam', 'yogi', 'adagrad'",
        ),
        (lambda: FedOptRecipe(**DIGITS, server_lr=0), ValueError, r"server_lr: expected a number in \(0, inf\)"),
        (lambda: FedOptRecipe(**DIGITS, momentum=1.0), ValueError, r"momentum: expected a number in \[0, 1\)"),
        (lambda: FedOptRecipe(**DIGITS, beta2=-0.1), ValueError, "beta2"),
        (lambda: FedOptRecipe(**DIGITS, epsilon=0.0), ValueError, "epsilon"),
        (
            lambda: FedOptRecipe(**DIGITS, workflow_args={"server_lr": 1.0}, server_lr=0.1),
            ValueError,
            "workflow_args: 'server_lr' is set by the recipe",
        ),
        (
            lambda: SwarmRecipe(**DIGITS, min_responses_required=0),
            ValueError,
            "min_responses_required: expected an integer >= 1",
        ),
        (
            lambda: SwarmRecipe(**DIGITS, client_args={"aggregator_id": "x"}),
            ValueError,
            "client_args: 'aggregator_id' is set by the recipe",
        ),
        (lambda: SwarmRecipe(**bad(num_rounds=0)), ValueError, "num_rounds: expected an integer >= 1"),
        (lambda: CrossSiteEvalRecipe(**DIGITS, eval_task_timeout=0), ValueError, "eval_task_timeout"),
        (
            lambda: CrossSiteEvalRecipe(**DIGITS, evaluators="site-1"),
            TypeError,
            "evaluators: expected a list of site names",
        ),
        (
            lambda: CrossSiteEvalRecipe(**DIGITS, evaluatees="@none", global_model_client="@none"),
            ValueError,
            "nothing to evaluate",
        ),
        (
            lambda: CrossSiteEvalRecipe(**DIGITS, cse_args={"metric_ranges": {}}),
            ValueError,
            "use its argument eval_metric_ranges",
        ),
    ],
    ids=lambda value: "" if callable(value) or isinstance(value, type) else value[:40],
)
def test_a_bad_argument_is_refused_when_the_recipe_is_built_naming_it(make, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make()


def test_a_model_instance_needs_its_args_an_importable_class_and_matching_tensors() -> None:
    with job_code_on_path(CUSTOM):
        from net import Net

    class Local(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(2, 2)

    with pytest.raises(
        ValueError, match=r"model: a Net instance does not tell its constructor's arguments; pass model_args"
    ):
        FedAvgRecipe(**{**DIGITS, "model": Net(hidden=16), "model_args": None})
    with pytest.raises(ValueError, match=r"model_args: Net\(\*\*\{'hidden': 8\}\) has other tensors than the instance"):
        FedAvgRecipe(**{**DIGITS, "model": Net(hidden=16), "model_args": {"hidden": 8}})
    with pytest.raises(ValueError, match=r"model_args: Net\(\*\*\{'width': 8\}\) failed"):
        FedAvgRecipe(**{**DIGITS, "model": Net(hidden=16), "model_args": {"width": 8}})
    with pytest.raises(ValueError, match="model: class .*Local is defined in a function"):
        FedAvgRecipe(**{**DIGITS, "model": Local(), "model_args": {}})
    with pytest.raises(
        ValueError, match=r"model: class net.Net comes from .*net.py, which the job does not carry; add that file"
    ):
        FedAvgRecipe(**{**DIGITS, "model": Net(hidden=16), "custom_files": []})
    with pytest.raises(ValueError, match="initial_checkpoint: the model instance's weights already start the job"):
        FedAvgRecipe(**{**DIGITS, "model": Net(hidden=16)}, initial_checkpoint=CUSTOM / "net.py")


def test_an_installed_class_needs_no_custom_file(tmp_path: Path) -> None:
    recipe = FedAvgRecipe(
        **{**DIGITS, "model": torch.nn.Linear(64, 10), "model_args": {"in_features": 64, "out_features": 10}}
    )

    assert recipe.model.path == "torch.nn.modules.linear.Linear"


@pytest.mark.parametrize(
    ("side", "config", "error", "message"),
    [
        ("server", {"workflows": []}, ValueError, "add_server_config: 'workflows' is written by the recipe"),
        ("client", {"executors": []}, ValueError, "add_client_config: 'executors' is written by the recipe"),
        ("server", {"tensor_chunk": 1}, ValueError, "add_server_config: unknown key 'tensor_chunk'; expected one of"),
        (
            "server",
            {"tensor_download_chunk_size": "2MB"},
            ValueError,
            'add_server_config: tensor_download_chunk_size: expected an integer, got "2MB"',
        ),
        (
            "client",
            {"streaming_per_request_timeout": 0},
            ValueError,
            "add_client_config: streaming_per_request_timeout",
        ),
        ("client", {"cell": {"port": 70000}}, ValueError, "add_client_config: cell.port"),
        ("server", ["tensor_download_chunk_size"], TypeError, "add_server_config: expected a dict"),
    ],
    ids=["workflows", "executors", "unknown", "type", "range", "nested", "not-a-dict"],
)
def test_a_bad_top_level_setting_is_refused_naming_its_key(side: str, config: Any, error: type, message: str) -> None:
    recipe = FedAvgRecipe(**DIGITS)

    with pytest.raises(error, match=message):
        getattr(recipe, f"add_{side}_config")(config)


def test_components_and_filters_are_added_where_asked_and_their_ids_stay_unique(tmp_path: Path) -> None:
    recipe = FedAvgRecipe(**DIGITS)
    recipe.add_server_component("robust", "engine.aggregators.TrimmedMeanAggregator", {"trim_fraction": 0.1})
    recipe.add_client_filter("engine.filters.ExcludeVars", {"exclude_vars": ["layers.2.bias"]}, tasks=["train"])
    recipe.add_server_filter("engine.filters.ExcludeVars", {"exclude_vars": ["x"]}, kind="task_data")

    folder = recipe.export(tmp_path / "job")

    configs = written(folder)
    assert configs[SERVER_CONFIG]["components"][-1] == {
        "id": "robust",
        "path": "engine.aggregators.TrimmedMeanAggregator",
        "args": {"trim_fraction": 0.1},
    }
    assert configs[CLIENT_CONFIG]["task_result_filters"] == [
        {
            "tasks": ["train"],
            "filters": [{"path": "engine.filters.ExcludeVars", "args": {"exclude_vars": ["layers.2.bias"]}}],
        }
    ]
    assert configs[SERVER_CONFIG]["task_data_filters"][0]["filters"][0]["args"] == {"exclude_vars": ["x"]}
    with pytest.raises(ValueError, match="add_server_component: id 'persistor' is taken"):
        recipe.add_server_component("persistor", "a.B")
    with pytest.raises(ValueError, match="add_server_component: id 'robust' is taken"):
        recipe.add_server_component("robust", "a.B")
    with pytest.raises(ValueError, match="add_client_filter: kind: expected one of 'task_data', 'task_result'"):
        recipe.add_client_filter("a.B", kind="result")


def test_execute_takes_a_sim_env_only() -> None:
    recipe = FedAvgRecipe(**DIGITS)

    with pytest.raises(TypeError, match="env: expected a SimEnv, got dict"):
        recipe.execute({"num_clients": 2})
    assert SimEnv(num_clients=2).num_clients == 2


def test_an_initial_checkpoint_is_copied_next_to_the_config_and_named_by_the_persistor(tmp_path: Path) -> None:
    with job_code_on_path(CUSTOM):
        from net import Net

    checkpoint = tmp_path / "start.safetensors"
    save_file({name: t.contiguous() for name, t in Net(hidden=16).state_dict().items()}, checkpoint)
    recipe = FedAvgRecipe(**DIGITS, initial_checkpoint=checkpoint)

    folder = recipe.export(tmp_path / "job")

    assert (folder / "app" / "initial_model.safetensors").read_bytes() == checkpoint.read_bytes()
    persistor_args = written(folder)[SERVER_CONFIG]["components"][0]["args"]
    assert persistor_args["source_ckpt_file_full_name"] == "initial_model.safetensors"


def test_the_recipe_keeps_its_own_copy_of_what_it_was_given() -> None:
    model_args, ranges, extra = {"hidden": 16}, {"acc": [0, 1]}, {"train_timeout": 5.0}
    recipe = FedAvgRecipe(**{**DIGITS, "model_args": model_args}, metric_ranges=ranges, workflow_args=extra)
    before = recipe.configs()

    model_args["hidden"] = 99
    ranges["acc"][1] = 5
    extra["train_timeout"] = 0.0
    recipe.configs()[SERVER_CONFIG]["workflows"][0]["args"]["num_rounds"] = 99

    assert recipe.configs() == before


def test_quantize_puts_the_filter_where_models_leave_and_the_swarm_arg_on_the_executor(tmp_path: Path) -> None:
    fedavg = written(RECIPES["fedavg-quantized"]().export(tmp_path / "fedavg"))
    quantize = [{"tasks": ["*"], "filters": [{"path": "engine.filters.Quantize", "args": {"mode": "int8"}}]}]
    assert fedavg[SERVER_CONFIG]["task_data_filters"] == quantize
    assert fedavg[SERVER_CONFIG]["task_result_filters"] == []
    assert fedavg[CLIENT_CONFIG]["task_result_filters"] == quantize
    assert fedavg[CLIENT_CONFIG]["task_data_filters"] == []

    swarm = written(RECIPES["swarm-quantized"]().export(tmp_path / "swarm"))
    executor = swarm[CLIENT_CONFIG]["executors"][1]["executor"]
    assert executor["path"] == "engine.executors.ccwf.SwarmClientController"
    assert executor["args"]["quantize"] == "bf16"


def test_the_recipes_quantize_modes_are_the_filters() -> None:
    from engine.fobs.quantized import MODES
    from engine.recipes.recipe import QUANTIZE_MODES

    assert QUANTIZE_MODES == MODES
    with pytest.raises(ValueError, match="quantize: expected one of 'fp16', 'bf16', 'int8', 'int4', got 'int2'"):
        FedAvgRecipe(**DIGITS, quantize="int2")
    with pytest.raises(ValueError, match="quantize: expected one of"):
        SwarmRecipe(**DIGITS, quantize="fp8")
