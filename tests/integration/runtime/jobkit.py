"""Generated jobs for runtime tests: BenchNet (small) under FedAvg or ScatterAndGather, with the
BENCHMARK.md client update and faults to order."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tests.integration.runtime.conftest import processes_mentioning

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


def make_swarm_job(
    root: Path,
    *,
    num_rounds: int = 2,
    num_clients: int = 3,
    layers: int = 2,
    width: int = 32,
    chunk_bytes: int = 4096,
    script_args: str = "",
    swarm_args: dict[str, Any] | None = None,
    controller_args: dict[str, Any] | None = None,
    cross_site_eval: bool = False,
    validator_args: dict[str, Any] | None = None,
    starting_checkpoint: str = "",
) -> Path:
    """Write a Swarm job (BenchNet, the BENCHMARK.md update), with cross-site evaluation if asked.

    ``validator_args`` routes ``validate`` to ``bench_validator.BenchValidator`` (which can fail
    one validation) instead of the script. ``starting_checkpoint``: the persistor's
    ``source_ckpt_file_full_name`` (a file the test writes in the app folder).
    """
    job = root / "swarm_job"
    custom = job / "app" / "custom"
    (job / "app" / "config").mkdir(parents=True)
    custom.mkdir()
    for name in ("benchnet_model.py", "bench_client.py", "bench_validator.py"):
        shutil.copy(JOB_CODE / name, custom / name)
    (job / "meta.conf").write_text(f'name = swarm\nmin_clients = {num_clients}\ndeploy_map {{ app = ["@ALL"] }}\n')
    swarm = {"num_rounds": num_rounds, "start_task_timeout": 60, "max_status_report_interval": 30}
    swarm.update(swarm_args or {})
    workflows = [{"id": "swarm", "path": "engine.workflows.ccwf.SwarmServerController", "args": swarm}]
    if cross_site_eval:
        workflows.append(
            {
                "id": "cse",
                "path": "engine.workflows.ccwf.CrossSiteEvalServerController",
                "args": {"eval_task_timeout": 60},
            }
        )
    streaming = f"tensor_download_chunk_size = {chunk_bytes}\nnp_download_chunk_size = {chunk_bytes}\n{FAST_CELL}"
    (job / "app" / "config" / "config_fed_server.conf").write_text(
        f"format_version = 2\n{streaming}workflows = {json.dumps(workflows)}\n"
    )
    controller = {
        "learn_task_name": "train",
        "min_responses_required": num_clients,
        "wait_time_after_min_resps_received": 0,
        "learn_task_timeout": 120,
    }
    controller.update(controller_args or {})
    script = {"task_script_path": "bench_client.py", "task_script_args": script_args}
    script_tasks = ["train", "submit_model"] + ([] if validator_args is not None else ["validate"])
    executors = [
        {"tasks": script_tasks, "executor": {"path": "engine.executors.ClientAPIExecutor", "args": script}},
        {"tasks": ["swarm_*"], "executor": {"path": "engine.executors.ccwf.SwarmClientController", "args": controller}},
        {"tasks": ["cse_*"], "executor": {"path": "engine.executors.ccwf.CrossSiteEvalClientController"}},
    ]
    if validator_args is not None:
        executors.insert(
            0, {"tasks": ["validate"], "executor": {"path": "bench_validator.BenchValidator", "args": validator_args}}
        )
    (job / "app" / "config" / "config_fed_client.conf").write_text(
        f"format_version = 2\n{streaming}executors = {json.dumps(executors)}\n"
        f"components = [{{ id = persistor, path = engine.persistors.PTFileModelPersistor, args {{\n"
        f"  model {{ path = benchnet_model.BenchNet, args {{ layers = {layers}, width = {width} }} }}\n"
        + (f"  source_ckpt_file_full_name = {json.dumps(starting_checkpoint)}\n" if starting_checkpoint else "")
        + "  } }\n"
        "  { id = aggregator, path = engine.aggregators.DXOAggregator, args { expected_data_kind = WEIGHTS } }\n"
        "  { id = shareable_generator, path = engine.workflows.FullModelShareableGenerator } ]\n"
    )
    return job


def _workflow(workflow: str, args: dict[str, Any]) -> str:
    if workflow == "fedavg":
        return f"workflows = [{{ id = fedavg, path = engine.workflows.FedAvg, args = {json.dumps(args)} }}]\n"
    num_clients = args.pop("num_clients")
    sag = {"min_clients": args.pop("min_clients", num_clients), "wait_time_after_min_received": 0}
    sag.update(args)
    return f"workflows = [{{ id = sag, path = engine.workflows.ScatterAndGather, args = {json.dumps(sag)} }}]\n"


def expected_delta(num_clients: int, sites: list[int] | None = None) -> float:
    """D of BENCHMARK.md: what one round adds to every parameter (``sites``: who took part, 1-based)."""
    ks = sites or range(1, num_clients + 1)
    return sum(k * 0.001 * k * 100 for k in ks) / sum(k * 100 for k in ks)


def pids_of(*words: str) -> list[int]:
    """Pids of live processes whose command line holds all ``words``."""
    found = []
    for line in processes_mentioning(words[0]):
        if all(word in line for word in words):
            found.append(int(line.split(":", 1)[0]))
    return found


def kill_when_a_download_starts(folder: Path, *words: str, timeout_s: float = 60.0) -> bool:
    """SIGKILL the processes named by ``words`` as soon as a disk download appears under ``folder``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if folder.exists() and any(folder.glob("run-*/xfer-*")):
            for pid in pids_of(*words):
                os.kill(pid, signal.SIGKILL)
            return True
        time.sleep(0.005)
    return False


def in_background(function, *args):
    """Run ``function(*args)`` in a thread; return a callable that joins it and gives its result."""
    box: dict[str, object] = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", function(*args)), daemon=True)
    thread.start()

    def join():
        thread.join(120)
        return box["result"]

    return join
