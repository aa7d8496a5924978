"""Generated jobs for runtime tests: BenchNet (small) under FedAvg or ScatterAndGather, with the
BENCHMARK.md client update and faults to order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

JOB_CODE = Path(__file__).parent / "job_code"
FAST_CELL = "cell { heartbeat_interval_s = 0.5, heartbeat_timeout_s = 3.0 }\n"


def make_bench_job(
    root: Path,
    *,
    num_rounds: int = 2,
    num_clients: int = 2,
    min_clients: int | None = None,
    layers: int = 2,
    width: int = 32,
    script_args: str = "",
    execution_mode: str = "in_process",
    chunk_bytes: int = 2097152,
    workflow_args: dict[str, Any] | None = None,
    server_extra: str = "",
    client_extra: str = "",
    workflow: str = "fedavg",
) -> Path:
    """Write a job folder under ``root`` and return it: FedAvg, or ScatterAndGather (``"sag"``)."""
    job = root / "bench_job"
    custom = job / "app" / "custom"
    (job / "app" / "config").mkdir(parents=True)
    custom.mkdir()
    for name in ("benchnet_model.py", "bench_client.py"):
        shutil.copy(JOB_CODE / name, custom / name)
    args = {"num_clients": num_clients, "num_rounds": num_rounds, "persistor_id": "persistor"}
    if min_clients is not None:
        args["min_clients"] = min_clients
    args.update(workflow_args or {})
    (job / "meta.conf").write_text(f'name = bench\nmin_clients = {num_clients}\ndeploy_map {{ app = ["@ALL"] }}\n')
    (job / "app" / "config" / "config_fed_server.conf").write_text(
        f"format_version = 2\n"
        f"tensor_download_chunk_size = {chunk_bytes}\n"
        f"np_download_chunk_size = {chunk_bytes}\n"
        f"{FAST_CELL}"
        f"{_workflow(workflow, args)}"
        f"components = [{{ id = persistor, path = engine.persistors.PTFileModelPersistor, args {{\n"
        f"  model {{ path = benchnet_model.BenchNet, args {{ layers = {layers}, width = {width} }} }} }} }}\n"
        f"  {{ id = aggregator, path = engine.aggregators.DXOAggregator, args {{ expected_data_kind = WEIGHTS }} }}\n"
        f"  {{ id = shareable_generator, path = engine.workflows.FullModelShareableGenerator }} ]\n"
        f"{server_extra}"
    )
    (job / "app" / "config" / "config_fed_client.conf").write_text(
        f"format_version = 2\n"
        f"tensor_download_chunk_size = {chunk_bytes}\n"
        f"np_download_chunk_size = {chunk_bytes}\n"
        f"{FAST_CELL}"
        f'executors = [{{ tasks = ["*"], executor {{ path = engine.executors.ClientAPIExecutor, args {{\n'
        f"  task_script_path = bench_client.py, task_script_args = {json.dumps(script_args)},\n"
        f"  execution_mode = {execution_mode} }} }} }}]\n"
        f"{client_extra}"
    )
    return job


def _workflow(workflow: str, args: dict[str, Any]) -> str:
    if workflow == "fedavg":
        return f"workflows = [{{ id = fedavg, path = engine.workflows.FedAvg, args = {json.dumps(args)} }}]\n"
    num_clients = args.pop("num_clients")
    sag = {"min_clients": args.pop("min_clients", num_clients), "wait_time_after_min_received": 0}
    sag.update(args)
    return f"workflows = [{{ id = sag, path = engine.workflows.ScatterAndGather, args = {json.dumps(sag)} }}]\n"


def expected_delta(num_clients: int) -> float:
    """D of BENCHMARK.md: what one round adds to every parameter."""
    ks = range(1, num_clients + 1)
    return sum(k * 0.001 * k * 100 for k in ks) / sum(k * 100 for k in ks)
