"""Recipes run in the simulator: FedAvg on the digits example, and cross-site evaluation, from a model instance's weights."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.examples.digits import Net, load_split
from engine.recipes import CrossSiteEvalRecipe, FedAvgRecipe, FedOptRecipe
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import processes_mentioning

CUSTOM = Path(__file__).resolve().parents[3] / "engine" / "examples"  # the example's train.py


def test_fedavg_recipe_runs_the_digits_example_to_completion(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = Net(hidden=16)
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    recipe = FedAvgRecipe(
        model=model,
        model_args={"hidden": 16},
        train_script=CUSTOM / "train.py",
        train_args=["--epochs", "1", "--hidden", "16"],
        custom_files=[],
        num_rounds=1,
        num_clients=2,
        key_metric="global_accuracy",
    )
    recipe.add_server_config({"tensor_download_chunk_size": 4096})  # the model streams in many chunks
    recipe.add_client_config({"tensor_download_chunk_size": 4096})

    result = recipe.run(workspace=tmp_path / "workspace", out=io.StringIO())

    assert result.state is JobState.FINISHED_COMPLETED, result.summary
    summary = json.loads((result.workspace / "summary.json").read_text(encoding="utf-8"))
    assert summary == json.loads(json.dumps(result.summary))
    assert summary["job"] == "fedavg" and len(summary["rounds"]) == 1 and summary["warnings"] == []
    final = load_file(result.workspace / "server" / "models" / "global.safetensors")
    assert {name: t.shape for name, t in final.items()} == {name: t.shape for name, t in initial.items()}
    assert not all(torch.equal(final[name], tensor) for name, tensor in initial.items())  # trained from there
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow
def test_cross_site_eval_without_training_validates_the_instance_given(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = Net(hidden=16)
    expected = {}
    for index, site in enumerate(["site-1", "site-2"]):  # train.py's validate: its part of the validation set
        _, (val_x, val_y) = load_split(index, 2)
        mine = slice(index, None, 2)
        with torch.no_grad():
            expected[site] = (model(val_x[mine]).argmax(dim=1) == val_y[mine]).float().mean().item()
    recipe = CrossSiteEvalRecipe(
        model=model,
        model_args={"hidden": 16},
        train_script=CUSTOM / "train.py",
        train_args="--hidden 16",
        custom_files=[],
        num_rounds=0,
        evaluatees="@none",
    )

    result = recipe.run(workspace=tmp_path / "workspace", out=io.StringIO())

    assert result.state is JobState.FINISHED_COMPLETED, result.summary
    matrix = result.summary["cross_site_val"]
    assert {site: row["global (site-1)"]["accuracy"] for site, row in matrix.items()} == pytest.approx(expected)
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow
def test_fedopt_recipe_with_sgd_at_rate_one_ends_where_fedavg_does(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = Net(hidden=16)
    common = {
        "model": model,
        "model_args": {"hidden": 16},
        "train_script": CUSTOM / "train.py",
        "train_args": "--epochs 1 --hidden 16",
        "custom_files": [],
        "num_rounds": 2,
        "key_metric": "global_accuracy",
    }

    fedopt = FedOptRecipe(**common, server_optimizer="sgd", server_lr=1.0).run(tmp_path / "fedopt", out=io.StringIO())
    fedavg = FedAvgRecipe(**common).run(tmp_path / "fedavg", out=io.StringIO())

    assert fedopt.state is JobState.FINISHED_COMPLETED, fedopt.summary
    assert fedavg.state is JobState.FINISHED_COMPLETED, fedavg.summary
    ours = load_file(fedopt.workspace / "server" / "models" / "global.safetensors")
    theirs = load_file(fedavg.workspace / "server" / "models" / "global.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, rtol=0, atol=1e-5), name
    assert processes_mentioning(str(tmp_path)) == []
