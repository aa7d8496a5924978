"""Job folders with lying sites: the digits example's training on every site, some of them liars.

`make_liar_job` writes a job whose sites all run ``liar_train.py`` (the example's script, wrapped):
the honest ones with ``--attack none``, the lying ones with their attack, every one dealing the
data into ``num_clients`` shards; under FedAvg with any aggregator. Used by the robustness tests
and `tools/bench_robust.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.examples.digits import Net

LIAR_SCRIPT = Path(__file__).parent / "liar_train.py"


def _hocon(value: Any) -> str:
    """``value`` written as HOCON (JSON is HOCON)."""
    return json.dumps(value)


def make_liar_job(
    folder: Path,
    *,
    num_clients: int,
    liars: dict[str, str],
    num_rounds: int = 3,
    epochs: int = 1,
    factor: float = 10.0,
    min_clients: int | None = None,
    aggregator: dict[str, Any] | None = None,
    workflow_args: dict[str, Any] | None = None,
    download_to_disk: bool = False,
    seed: int = 0,
) -> Path:
    """Write the job into ``folder`` (created) and return it.

    Args:
        folder: The job folder to create.
        num_clients: Sites ``site-1 .. site-N``; every one trains every round.
        liars: Site -> attack of ``liar_train.py`` (``scale``, ``flip``, ``nan``, ...).
        num_rounds: FedAvg rounds.
        epochs: Local epochs per round.
        factor: The ``--factor`` of scaled and flipped updates.
        min_clients: Results a round needs (all honest sites by default).
        aggregator: ``{"path": ..., "args": {...}}`` of the aggregator component (weighted
            FedAvg when None).
        workflow_args: More FedAvg args.
        download_to_disk: FedAvg's ``download_to_disk``.
        seed: Seeds the initial model (written into the job as ``initial.safetensors``), so
            two jobs made with the same seed start from the same weights.
    """
    sites = [f"site-{i}" for i in range(1, num_clients + 1)]
    honest = [site for site in sites if site not in liars]
    folder.mkdir(parents=True)
    for app in ("app", *(f"liar_{site.replace('-', '_')}" for site in liars)):
        (folder / app / "custom").mkdir(parents=True)
        (folder / app / "config").mkdir()
        shutil.copy(LIAR_SCRIPT, folder / app / "custom" / "liar_train.py")
    _write_initial_model(folder / "app", seed)
    deploy_map = {"app": ["server", *honest]}
    script_args = f"--epochs {epochs} --num-shards {num_clients}"
    _client_config(folder / "app", "liar_train.py", f"{script_args} --attack none")
    for site, attack in liars.items():
        app = f"liar_{site.replace('-', '_')}"
        _client_config(folder / app, "liar_train.py", f"{script_args} --attack {attack} --factor {factor}")
        deploy_map[app] = [site]
    (folder / "meta.conf").write_text(
        f"name = liars\nmin_clients = {min_clients or len(honest)}\ndeploy_map = {_hocon(deploy_map)}\n",
        encoding="utf-8",
    )
    args = {
        "num_clients": num_clients,
        "min_clients": min_clients or len(honest),
        "num_rounds": num_rounds,
        "persistor_id": "persistor",
        "download_to_disk": download_to_disk,
        "metric_ranges": {"global_accuracy": [0, 1], "local_accuracy": [0, 1]},
        "wait_time_after_min_received": 60,  # ends early once every site answered
        **(workflow_args or {}),
    }
    components = [
        {
            "id": "persistor",
            "path": "engine.persistors.PTFileModelPersistor",
            "args": {
                "model": {"path": "engine.examples.digits.Net", "args": {"hidden": 64}},
                "key_metric": "global_accuracy",
                "source_ckpt_file_full_name": "initial.safetensors",
            },
        }
    ]
    if aggregator is not None:
        components.append({"id": "robust", **aggregator})
        args["aggregator_id"] = "robust"
    server = {
        "format_version": 2,
        "workflows": [{"id": "fedavg", "path": "engine.workflows.FedAvg", "args": args}],
        "components": components,
    }
    (folder / "app" / "config" / "config_fed_server.conf").write_text(_hocon(server) + "\n", encoding="utf-8")
    return folder


def _client_config(app: Path, script: str, script_args: str) -> None:
    client = {
        "format_version": 2,
        "executors": [
            {
                "tasks": ["*"],
                "executor": {
                    "path": "engine.executors.ClientAPIExecutor",
                    "args": {"task_script_path": script, "task_script_args": script_args},
                },
            }
        ],
    }
    (app / "config" / "config_fed_client.conf").write_text(_hocon(client) + "\n", encoding="utf-8")


def _write_initial_model(app: Path, seed: int) -> None:
    """The digits MLP's starting weights, from ``seed``."""
    torch.manual_seed(seed)
    save_file({name: t.contiguous() for name, t in Net(hidden=64).state_dict().items()}, app / "initial.safetensors")
