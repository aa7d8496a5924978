"""A training script launched with torchrun (2 ranks, gloo on the CPU) through the simulator and the executor.

Each site's script runs as two processes: rank 0 talks to the engine, rank 1 gets every task by
broadcast; both train on their half of the site's data and all-reduce the gradients, so both end
each round with the same model, and rank 0 sends it. The test recomputes the whole run on its own
(the same data, the same steps, FedAvg's mean) and compares the server's final model with it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from threading import Event

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.executors.client_api import REASON_HEADER, ClientAPIExecutor
from engine.executors.executor import ExecutorContext
from engine.model import FLModel, ReturnCode, model_from_shareable, shareable_from_model
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import processes_mentioning

TORCHRUN = "torchrun --standalone --nproc_per_node 2"
NUM_ROUNDS = 2
STEPS = 3
LR = 0.1

TINYNET = '''\
"""A 4 -> 1 linear model with fixed initial weights (so the test can recompute the run)."""
import torch


class TinyNet(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 1)
        with torch.no_grad():
            self.weight.copy_(torch.tensor([[0.5, -0.25, 0.125, 1.0]]))
            self.bias.fill_(0.1)


def shard(site: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one rank of one site: 8 samples of y = x . (1, 2, 3, 4) + 0.5 + noise."""
    generator = torch.Generator().manual_seed(100 * site + rank)
    x = torch.randn(8, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [2.0], [3.0], [4.0]]) + 0.5 + 0.01 * torch.randn(8, 1, generator=generator)
    return x, y
'''

TRAIN_DDP = '''\
"""Data-parallel training on 2 ranks: both get the global model, all-reduce gradients, rank 0 sends."""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from engine import client as flare
from engine.model import FLModel
from tinynet import TinyNet, shard

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--into", action="store_true", help="receive the weights into the network's own tensors")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
flare.init()
site = flare.get_site_name()
x, y = shard(int(site.rsplit("-", 1)[-1]), rank)
net = TinyNet()
while flare.is_running():
    model = flare.receive(into=net) if args.into else flare.receive()
    if model is None:
        break
    if rank == model.meta.get("fail_rank"):
        raise RuntimeError(f"rank {rank} failed on purpose")
    received = {name: tensor.tolist() for name, tensor in model.params.items()}
    net.load_state_dict(model.params)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
    for _ in range(args.steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
    record = {
        "received": received,
        "trained": {name: tensor.tolist() for name, tensor in net.state_dict().items()},
        "task": flare.get_task_name(),
        "endpoint_in_env": "FLENGINE_CLIENT_API_ENDPOINT" in os.environ,
    }
    out = Path(args.out) / f"{site}-round{model.current_round}-rank{rank}.json"
    out.write_text(json.dumps(record))
    flare.send(FLModel(params=net.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": args.steps}))
with (Path(args.out) / f"{site}-end-rank{rank}.txt").open("w") as end:
    end.write(str(flare.is_running()))
dist.destroy_process_group()
'''


def _write_custom(custom: Path) -> None:
    custom.mkdir(parents=True, exist_ok=True)
    (custom / "tinynet.py").write_text(TINYNET)
    (custom / "train_ddp.py").write_text(TRAIN_DDP)


def make_torchrun_job(root: Path, out: Path) -> Path:
    """FedAvg over 2 sites whose script runs under torchrun with 2 ranks."""
    job = root / "torchrun_job"
    (job / "app" / "config").mkdir(parents=True)
    _write_custom(job / "app" / "custom")
    (job / "meta.conf").write_text('name = torchrun\nmin_clients = 2\ndeploy_map { app = ["@ALL"] }\n')
    (job / "app" / "config" / "config_fed_server.conf").write_text(
        "format_version = 2\n"
        "workflows = [{ id = fedavg, path = engine.workflows.FedAvg,\n"
        f"  args {{ num_clients = 2, num_rounds = {NUM_ROUNDS}, persistor_id = persistor }} }}]\n"
        "components = [{ id = persistor, path = engine.persistors.PTFileModelPersistor,\n"
        "  args { model { path = tinynet.TinyNet } } }]\n"
    )
    (job / "app" / "config" / "config_fed_client.conf").write_text(
        "format_version = 2\n"
        'executors = [{ tasks = ["*"], executor { path = engine.executors.ClientAPIExecutor, args {\n'
        f'  task_script_path = train_ddp.py, task_script_args = "--out {out} --steps {STEPS} --lr {LR} --into",\n'
        f'  execution_mode = subprocess, command = "{TORCHRUN}" }} }} }}]\n'
    )
    return job


def expected_global_models(
    custom: Path, sites: tuple[int, ...] = (1, 2), rounds: int = NUM_ROUNDS
) -> list[dict[str, torch.Tensor]]:
    """The global model after each round, recomputed here: per site, the mean gradient of its two
    shards for `STEPS` SGD steps; then FedAvg's mean of the sites (equal steps, equal weights)."""
    with job_code_on_path(custom):
        from tinynet import TinyNet, shard

        net = TinyNet()
    global_model = {name: t.detach().clone() for name, t in net.state_dict().items()}
    models = []
    for _ in range(rounds):
        locals_ = []
        for site in sites:
            weight, bias = global_model["weight"].clone(), global_model["bias"].clone()
            for _ in range(STEPS):
                grads = []
                for rank in (0, 1):
                    x, y = shard(site, rank)
                    error = x @ weight.T + bias - y  # d/dw mean((xw + b - y)^2) = 2/n x^T e
                    grads.append((2 / len(x) * error.T @ x, 2 / len(x) * error.sum(0)))
                weight -= LR * (grads[0][0] + grads[1][0]) / 2
                bias -= LR * (grads[0][1] + grads[1][1]) / 2
            locals_.append({"weight": weight, "bias": bias})
        global_model = {name: sum(local[name] for local in locals_) / len(locals_) for name in global_model}
        models.append(global_model)
    return models


@pytest.mark.slow  # ~15 s alone, 45 s on a busy 2-core machine: 2 sites x (torchrun + 2 ranks)
def test_torchrun_script_trains_on_two_ranks_and_the_server_gets_the_analytic_model(simulate, tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    out.mkdir()
    job = make_torchrun_job(tmp_path, out)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    expected = expected_global_models(job / "app" / "custom")
    initial = {"weight": [[0.5, -0.25, 0.125, 1.0]], "bias": [0.1]}
    for site in ("site-1", "site-2"):
        for round_ in range(NUM_ROUNDS):
            rank0, rank1 = (json.loads((out / f"{site}-round{round_}-rank{r}.json").read_text()) for r in (0, 1))
            assert rank0["received"] == rank1["received"], (site, round_)  # the broadcast is exact
            assert rank0["trained"] == rank1["trained"], (site, round_)  # all-reduced gradients
            assert rank0["task"] == rank1["task"] == "train"
            assert not rank1["endpoint_in_env"]  # rank 1 dropped the executor's address
            sent = initial if round_ == 0 else {k: v.tolist() for k, v in expected[round_ - 1].items()}
            for name, values in sent.items():
                assert torch.allclose(torch.tensor(rank0["received"][name]), torch.tensor(values), atol=1e-6)
        # is_running() turned False on both ranks in the same receive()
        assert [(out / f"{site}-end-rank{r}.txt").read_text() for r in (0, 1)] == ["False", "False"]
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    for name, tensor in expected[-1].items():
        assert torch.allclose(final[name], tensor, rtol=0, atol=1e-6), (name, final[name], tensor)
    stderr = (tmp_path / "workspace" / "site-1" / "stderr.txt").read_text()
    assert "client API request refused" not in stderr


def test_both_ranks_train_the_task_and_a_rank_that_fails_fails_the_next_with_its_error(tmp_path: Path) -> None:
    """The executor alone (no simulator): one torchrun launch answers a task, then loses a rank."""
    custom = tmp_path / "custom"
    _write_custom(custom)
    executor = ClientAPIExecutor(
        task_script_path="train_ddp.py",
        task_script_args=f"--out {tmp_path} --steps {STEPS} --lr {LR}",
        execution_mode="subprocess",
        command=TORCHRUN.split(),
    )
    executor.initialize(ExecutorContext("site-1", "job-1", workspace=tmp_path, custom_dir=custom))
    params = {"weight": torch.tensor([[0.5, -0.25, 0.125, 1.0]]), "bias": torch.tensor([0.1])}
    try:
        trained = executor.execute("train", shareable_from_model(FLModel(params=params, current_round=0)), Event())
        started = time.monotonic()
        failed = executor.execute(
            "train", shareable_from_model(FLModel(params=params, current_round=1, meta={"fail_rank": 1})), Event()
        )
        seconds = time.monotonic() - started
    finally:
        executor.finalize()

    assert trained.get_return_code() is ReturnCode.OK, trained.get_header(REASON_HEADER)
    rank0, rank1 = (json.loads((tmp_path / f"site-1-round0-rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["received"] == rank1["received"] == {k: v.tolist() for k, v in params.items()}
    assert rank0["trained"] == rank1["trained"]
    expected = expected_global_models(custom, sites=(1,), rounds=1)[0]  # one site: its model is the mean
    result = model_from_shareable(trained).params
    for name, tensor in expected.items():
        assert torch.allclose(result[name], tensor, rtol=0, atol=1e-6), name
        assert result[name].tolist() == rank0["trained"][name]
    assert failed.get_return_code() is ReturnCode.EXECUTION_EXCEPTION
    reason = failed.get_header(REASON_HEADER)
    assert "train_ddp.py exited with code 1 before answering the task" in reason, reason
    assert "RuntimeError: rank 1 failed on purpose" in reason, reason
    assert seconds < 60
    assert processes_mentioning(str(custom)) == []
