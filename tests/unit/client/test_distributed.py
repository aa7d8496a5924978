"""`engine.client.distributed`: the ranks of a torchrun launch, and rank 0 broadcasting tasks over real gloo.

Two threads play rank 0 and rank 1, each with its own gloo process group on one in-memory
store (the collective calls are real; only the processes are threads).
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zmq

from engine import client as flare
from engine.client import broadcast
from engine.client.backends import ENV_ENDPOINT, Backend, InProcessBackend, SubprocessBackend, install_backend
from engine.client.distributed import DistributedBackend, Ranks, connect_from_environment
from engine.client.exchange import TaskExchange, TaskItem
from engine.client.into import targets_of
from engine.errors import ClientAPIError, IntoMismatchError
from engine.model import FLModel, ParamsType
from engine.site import ScriptCredentials

#: Longest a test waits for a rank.
WAIT_S = 10.0

# ----------------------------------------------------------------------------- ranks


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, Ranks(0, 1, 0)),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, Ranks(0, 2, 0)),
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, Ranks(3, 4, 1)),
        ({"RANK": " ", "WORLD_SIZE": ""}, Ranks(0, 1, 0)),
    ],
    ids=["none", "rank-0-of-2", "rank-3-of-4", "blank"],
)
def test_ranks_come_from_the_launchers_variables(environ: dict[str, str], expected: Ranks) -> None:
    assert Ranks.from_environment(environ) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 and WORLD_SIZE=2 do not fit"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK=-1 and WORLD_SIZE=2 do not fit"),
        ({"WORLD_SIZE": "0"}, r"do not fit"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, r"RANK='one' is not a whole number"),
        ({"LOCAL_RANK": "1.5"}, r"LOCAL_RANK='1.5' is not a whole number"),
    ],
    ids=["rank-too-big", "negative", "empty-world", "word", "fraction"],
)
def test_bad_rank_variables_are_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ClientAPIError, match=message):
        Ranks.from_environment(environ)


@pytest.fixture
def script_environment(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The variables the executor gives a script (a closed port: nothing may connect to it)."""
    public, secret = zmq.curve_keypair()
    executor_public, _ = zmq.curve_keypair()
    values = {ENV_ENDPOINT: "tcp://127.0.0.1:9", **ScriptCredentials(public, secret, executor_public).to_environment()}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def test_a_rank_above_0_opens_no_connection_and_forgets_the_executors_address(
    script_environment: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("FLENGINE_SITE_NAME", "site-3")

    backend = connect_from_environment()

    assert isinstance(backend, DistributedBackend)
    assert backend.ranks == Ranks(1, 2, 0) and backend.site_name == "site-3"
    assert [name for name in script_environment if name in os.environ] == []


def test_the_subprocess_backend_refuses_a_rank_above_0(
    script_environment: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")

    with pytest.raises(ClientAPIError, match=r"only rank 0 connects to the executor, this process is RANK=1"):
        SubprocessBackend.from_environment()


def test_receive_without_a_process_group_says_to_init_one() -> None:
    assert not dist.is_initialized()
    backend = DistributedBackend(Ranks(1, 2), None, "site-1", "job")

    with pytest.raises(ClientAPIError, match=r"call torch.distributed.init_process_group\(...\) on every rank"):
        backend.receive(None)


@pytest.mark.parametrize(
    ("ranks", "leader"), [(Ranks(0, 2), None), (Ranks(1, 2), "leader")], ids=["rank-0-alone", "rank-1-connected"]
)
def test_only_rank_0_holds_the_connection(ranks: Ranks, leader: Any) -> None:
    backend = InProcessBackend(TaskExchange(), "s", "j") if leader else None
    with pytest.raises(ValueError, match="only rank 0 holds the connection"):
        DistributedBackend(ranks, backend, "s", "j")


# ----------------------------------------------------------------------------- broadcasting, two ranks


def _gloo_broadcasts(world_size: int = 2) -> list[Callable[[torch.Tensor], None]]:
    """One broadcast function per rank, each over its own gloo process group (made in parallel)."""
    store = dist.HashStore()
    groups: list[Any] = [None] * world_size

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=WAIT_S))

    _in_threads([lambda r=r: make(r) for r in range(world_size)])

    def broadcast_of(group: Any) -> Callable[[torch.Tensor], None]:
        def broadcast(tensor: torch.Tensor) -> None:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([tensor], options).wait()

        return broadcast

    return [broadcast_of(group) for group in groups]


def _in_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run ``jobs`` at once, one thread each; their results, or the first error raised again."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = jobs[index]()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads), "a rank hangs"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def ranks() -> Iterator[tuple[TaskExchange, DistributedBackend, DistributedBackend]]:
    """An exchange the test feeds, rank 0 on it, and rank 1; both wait at most 0.05 s between messages."""
    exchange = TaskExchange()
    leader_broadcast, follower_broadcast = _gloo_broadcasts()
    leader = DistributedBackend(
        Ranks(0, 2), InProcessBackend(exchange, "site-1", "job"), "site-1", "job", 0.05, leader_broadcast
    )
    follower = DistributedBackend(Ranks(1, 2, 1), None, "site-1", "job", 0.05, follower_broadcast)
    yield exchange, leader, follower
    exchange.end()


def _assert_same(got: Any, sent: Any, where: str) -> None:
    if isinstance(sent, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == sent.dtype and got.shape == sent.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)), where  # bitwise
    elif isinstance(sent, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == sent.dtype and got.shape == sent.shape, where
        assert np.array_equal(got, sent), where
    else:
        assert got == sent, where


def test_every_rank_gets_the_task_while_rank_0_waits_through_several_slices(
    ranks: tuple[TaskExchange, DistributedBackend, DistributedBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    exchange, leader, follower = ranks
    monkeypatch.setattr(broadcast, "BROADCAST_SLICE_BYTES", 1000)  # the 4 KiB tensor goes in 5 slices
    params = {
        "big": torch.arange(1024, dtype=torch.float32),
        "half": torch.tensor([[1.5, -2.25], [3.0, 1e-3]], dtype=torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "strided": torch.arange(12.0).reshape(3, 4).T,  # not contiguous
        "array": np.linspace(0.0, 1.0, 5),
        "flags": np.array([[True], [False]]),
        "scale": 0.25,
        "names": ["a", "b"],
    }
    sent = FLModel(
        params=params,
        params_type=ParamsType.FULL,
        metrics={"loss": 0.5},
        meta={"NUM_STEPS_CURRENT_ROUND": 3, "nested": {"k": [1, 2]}},
        current_round=4,
        total_rounds=9,
    )
    # The task comes after rank 0 has waited through a few 0.05 s slices, telling rank 1 each time.
    threading.Timer(0.3, lambda: exchange.put_task("train", sent)).start()

    got0, got1 = _in_threads([lambda: leader.receive(None), lambda: follower.receive(None)])

    assert got0 == TaskItem("train", sent) and got0.model is sent
    assert got1.task_name == "train" and follower.current is got1
    model = got1.model
    assert list(model.params) == list(params)
    for name, value in params.items():
        _assert_same(model.params[name], value.contiguous() if name == "strided" else value, name)
    assert (model.params_type, model.metrics, model.meta) == (ParamsType.FULL, {"loss": 0.5}, sent.meta)
    assert (model.current_round, model.total_rounds) == (4, 9)
    assert leader.is_running() and follower.is_running()


def test_a_task_without_params_reaches_every_rank(
    ranks: tuple[TaskExchange, DistributedBackend, DistributedBackend],
) -> None:
    exchange, leader, follower = ranks
    exchange.put_task("submit_model", FLModel(meta={"x": 1}))

    _, got1 = _in_threads([lambda: leader.receive(1.0), lambda: follower.receive(1.0)])

    assert got1.task_name == "submit_model" and got1.model.params is None and got1.model.meta == {"x": 1}


def test_only_rank_0_sends_and_the_run_ends_on_every_rank_in_the_same_receive(
    ranks: tuple[TaskExchange, DistributedBackend, DistributedBackend],
) -> None:
    exchange, leader, follower = ranks
    exchange.put_task("train", FLModel(params={"w": torch.ones(2)}))

    def script(backend: Backend, rank: int) -> list[Any]:
        install_backend(backend, this_thread_only=True)
        seen = []
        try:
            while flare.is_running():
                model = flare.receive(timeout=2.0)
                seen.append(None if model is None else model.params["w"].tolist())
                if model is None:
                    continue
                flare.log("rank", rank)
                flare.send(FLModel(params={"w": model.params["w"] * (rank + 2)}))
            return seen
        finally:
            install_backend(None, this_thread_only=True)

    def executor() -> FLModel | None:
        result = exchange.take_result(WAIT_S)
        exchange.end()
        return result

    seen0, seen1, result = _in_threads([lambda: script(leader, 0), lambda: script(follower, 1), executor])

    assert seen0 == seen1 == [[1.0, 1.0], None]  # the task, then the end: is_running() False on both
    assert result is not None and result.params["w"].tolist() == [2.0, 2.0]  # rank 0's, the only one
    assert exchange.take_result(0.01) is None


def test_receive_times_out_on_every_rank_and_the_run_goes_on(
    ranks: tuple[TaskExchange, DistributedBackend, DistributedBackend],
) -> None:
    _, leader, follower = ranks

    got = _in_threads([lambda: leader.receive(0.2), lambda: follower.receive(None)])

    assert got == [None, None]
    assert leader.is_running() and follower.is_running()


class _ExecutorGone(Backend):
    """Rank 0's connection when the executor went away: every receive raises."""

    def receive(self, timeout_s: float | None) -> TaskItem | None:
        raise ClientAPIError("the executor of site-1 went away: no reply")

    def send(self, model: FLModel) -> None:
        raise AssertionError("not reached")

    def is_running(self) -> bool:
        return True

    def log(self, key: str, value: Any) -> None:
        raise AssertionError("not reached")


def test_when_rank_0_cannot_receive_every_rank_raises_instead_of_waiting() -> None:
    leader_broadcast, follower_broadcast = _gloo_broadcasts()
    leader = DistributedBackend(Ranks(0, 2), _ExecutorGone("s", "j"), "s", "j", 0.05, leader_broadcast)
    follower = DistributedBackend(Ranks(1, 2), None, "s", "j", 0.05, follower_broadcast)
    errors: dict[int, str] = {}

    def receive(backend: DistributedBackend, rank: int) -> None:
        try:
            backend.receive(None)
        except ClientAPIError as e:
            errors[rank] = str(e)

    _in_threads([lambda: receive(leader, 0), lambda: receive(follower, 1)])

    assert errors[0] == "the executor of site-1 went away: no reply"
    assert "rank 1: rank 0 could not receive the task from the executor" in errors[1]
    assert not follower.is_running()


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Shapes of the tensors rank 1 allocates for a broadcast (the real allocator, counted)."""
    shapes: list[tuple[int, ...]] = []
    allocate = broadcast.pooled_empty

    def counted(shape: Any, dtype: torch.dtype) -> torch.Tensor:
        shapes.append(tuple(shape))
        return allocate(shape, dtype)

    monkeypatch.setattr(broadcast, "pooled_empty", counted)
    return shapes


def test_receive_into_writes_the_weights_into_every_ranks_own_tensors(
    ranks: tuple[TaskExchange, DistributedBackend, DistributedBackend], allocations: list[tuple[int, ...]]
) -> None:
    exchange, leader, follower = ranks
    sent = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.tensor([0.5, -0.5])}
    exchange.put_task("train", FLModel(params=sent, params_type=ParamsType.FULL))
    net0, net1 = (torch.nn.Linear(3, 2) for _ in range(2))
    before = {name: t.data_ptr() for name, t in net1.state_dict().items()}

    got0, got1 = _in_threads([lambda: flare_targets(leader, net0), lambda: flare_targets(follower, net1)])

    for net, got in ((net0, got0), (net1, got1)):
        assert torch.equal(net.weight.detach(), sent["weight"]) and torch.equal(net.bias.detach(), sent["bias"])
        assert got.model.params["weight"].data_ptr() == net.weight.data_ptr()
    assert {name: t.data_ptr() for name, t in net1.state_dict().items()} == before
    assert allocations == []  # broadcast straight into rank 1's tensors
    assert follower.current is got1


def test_receive_into_copies_into_targets_a_broadcast_cannot_write_and_names_a_mismatch(
    ranks: tuple[TaskExchange, DistributedBackend, DistributedBackend], allocations: list[tuple[int, ...]]
) -> None:
    exchange, leader, follower = ranks
    sent = {"w": torch.arange(6.0).reshape(2, 3)}
    strided = {"w": torch.zeros(3, 2).T}  # not contiguous: received beside it, then copied in
    exchange.put_task("train", FLModel(params=sent))
    _in_threads(
        [lambda: leader.receive_into(1.0, {"w": torch.zeros(2, 3)}), lambda: follower.receive_into(1.0, strided)]
    )
    assert torch.equal(strided["w"], sent["w"]) and allocations == [(2, 3)]

    wrong = {"w": torch.zeros(3, 3)}
    exchange.put_task("train", FLModel(params=sent))
    with pytest.raises(IntoMismatchError, match=r"'w' arrived with shape \(2, 3\), the target has \(3, 3\)"):
        _in_threads(
            [lambda: leader.receive_into(1.0, {"w": torch.zeros(2, 3)}), lambda: follower.receive_into(1.0, wrong)]
        )
    assert torch.equal(wrong["w"], torch.zeros(3, 3))  # nothing written


def flare_targets(backend: DistributedBackend, net: torch.nn.Module) -> TaskItem | None:
    return backend.receive_into(1.0, targets_of(net))
