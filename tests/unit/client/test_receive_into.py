"""``flare.receive(into=...)``: the checks and copies of `engine.client.into`, and the exchange's wait."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from engine.client.exchange import TaskExchange
from engine.client.into import fill_into, placement_of, targets_of
from engine.errors import ClientAPIError, IntoMismatchError
from engine.model import DXO, DataKind, FLModel, ParamsType, shareable_from_model
from engine.streaming.via_downloader import StreamedItem


def net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def received_for(module: nn.Module, seed: int = 7) -> dict[str, torch.Tensor]:
    """Params with the module's names, shapes and dtypes, and other values."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.rand(t.shape, generator=generator) * 100).to(t.dtype) for name, t in module.state_dict().items()
    }


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in module.state_dict().items()}


def test_fill_writes_exact_values_into_the_modules_own_memory() -> None:
    module = net()
    pointers = {name: t.data_ptr() for name, t in module.state_dict().items()}
    sent = received_for(module)

    model = fill_into(targets_of(module), FLModel(params=sent, current_round=3, meta={"k": 1}))

    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, sent[name]), name
        assert tensor.data_ptr() == pointers[name] == model.params[name].data_ptr()
    assert model.current_round == 3 and model.meta == {"k": 1}
    assert module[0].weight.requires_grad  # still a trainable parameter


def test_fill_takes_numpy_arrays_of_the_same_dtype() -> None:
    targets = {"w": torch.zeros(3)}

    fill_into(targets, FLModel(params={"w": np.array([1.0, 2.0, 3.0], dtype=np.float32)}))

    assert targets["w"].tolist() == [1.0, 2.0, 3.0]


def _missing(params: dict) -> None:
    params.pop("0.bias")


def _extra(params: dict) -> None:
    params["head.weight"] = torch.zeros(2)


def _shape(params: dict) -> None:
    params["2.weight"] = torch.zeros(3, 4)


def _dtype(params: dict) -> None:
    params["0.weight"] = params["0.weight"].double()


def _not_a_tensor(params: dict) -> None:
    params["0.bias"] = "weights"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(_missing, r"missing from the task: '0\.bias'", id="missing"),
        pytest.param(_extra, r"not in the target: 'head\.weight'", id="extra"),
        pytest.param(_shape, r"'2\.weight' arrived with shape \(3, 4\), the target has \(2, 4\)", id="shape"),
        pytest.param(_dtype, r"'0\.weight' arrived as torch\.float64, the target is torch\.float32", id="dtype"),
        pytest.param(_not_a_tensor, r"'0\.bias' arrived as a str, not a tensor", id="not-a-tensor"),
    ],
)
def test_a_mismatch_names_the_key_and_writes_nothing(change, message: str) -> None:
    module = net()
    before = snapshot(module)
    params = received_for(module)
    change(params)

    with pytest.raises(IntoMismatchError, match=message):
        fill_into(targets_of(module), FLModel(params=params))

    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} was written before the mismatch was found"


def test_a_diff_is_refused() -> None:
    module = net()

    with pytest.raises(IntoMismatchError, match="carries a DIFF"):
        fill_into(targets_of(module), FLModel(params=received_for(module), params_type=ParamsType.DIFF))


@pytest.mark.parametrize("params", [None, {}], ids=["none", "empty"])
def test_a_task_without_weights_leaves_the_target_untouched(params) -> None:
    module = net()
    before = snapshot(module)
    model = FLModel(params=params)

    assert fill_into(targets_of(module), model) is model
    assert all(torch.equal(t, before[n]) for n, t in module.state_dict().items())


def test_targets_of_a_dict_are_its_tensors_detached() -> None:
    weight = torch.zeros(2, requires_grad=True)

    targets = targets_of({"w": weight})

    assert targets["w"].data_ptr() == weight.data_ptr() and not targets["w"].requires_grad


@pytest.mark.parametrize(
    ("into", "message"),
    [
        pytest.param([torch.zeros(1)], "expected a torch.nn.Module or a dict of tensors, got list", id="list"),
        pytest.param({"w": [1.0]}, "key 'w' holds a list", id="not-a-tensor"),
    ],
)
def test_targets_of_refuses_what_is_not_a_module_or_tensors(into, message: str) -> None:
    with pytest.raises(ClientAPIError, match=message):
        targets_of(into)


def test_placement_maps_streamed_items_of_a_model_or_a_dxo() -> None:
    targets = {"a": torch.zeros(1), "b": torch.zeros(1)}
    items = {"a": StreamedItem("tensors", "0"), "b": StreamedItem("tensors", "1")}

    from_model = placement_of(shareable_from_model(FLModel(params=dict(items))), targets)
    from_dxo = placement_of(DXO(DataKind.WEIGHTS, dict(items)).to_shareable(), targets)

    assert from_model == from_dxo == {items["a"]: targets["a"], items["b"]: targets["b"]}


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(FLModel(params={"a": StreamedItem("tensors", "0")}), id="names-differ"),
        pytest.param(
            FLModel(
                params={"a": StreamedItem("tensors", "0"), "b": StreamedItem("tensors", "1")},
                params_type=ParamsType.DIFF,
            ),
            id="diff",
        ),  # fmt: skip
        pytest.param(FLModel(metrics={"acc": 1.0}), id="no-params"),
    ],
)
def test_nothing_is_placed_when_the_names_do_not_match(model: FLModel) -> None:
    assert placement_of(model, {"a": torch.zeros(1), "b": torch.zeros(1)}) == {}


# ----------------------------------------------------------------- the exchange's wait


def _taker(exchange: TaskExchange, timeout_s: float, into: dict | None, out: list) -> threading.Thread:
    def take() -> None:
        started = time.monotonic()
        out.append((exchange.take_task(timeout_s, into=into), time.monotonic() - started))

    thread = threading.Thread(target=take)
    thread.start()
    return thread


def test_a_claimed_script_waits_past_its_timeout_for_the_task_into_its_tensors() -> None:
    exchange, taken = TaskExchange(), []
    targets = {"w": torch.zeros(1)}
    thread = _taker(exchange, 0.1, targets, taken)

    waiting, seen = exchange.claim_taker(5.0)
    time.sleep(0.3)  # past the script's timeout
    exchange.put_task("train", FLModel(params={"w": torch.ones(1)}))
    thread.join(5.0)

    assert waiting and seen is targets
    item, waited_s = taken[0]
    assert item is not None and item.task_name == "train" and waited_s >= 0.3


def test_a_released_claim_lets_the_timeout_count_again() -> None:
    exchange, taken = TaskExchange(), []
    thread = _taker(exchange, 0.1, {"w": torch.zeros(1)}, taken)
    exchange.claim_taker(5.0)
    time.sleep(0.2)

    exchange.release_claim()
    thread.join(5.0)

    assert taken[0][0] is None


def test_a_script_without_into_is_seen_waiting_and_claims_nothing() -> None:
    exchange, taken = TaskExchange(), []
    thread = _taker(exchange, 0.2, None, taken)

    assert exchange.claim_taker(5.0) == (True, None)
    thread.join(5.0)
    assert taken[0][0] is None  # its own timeout still counts
    assert exchange.claim_taker(0.05) == (False, None)  # nobody waits now


@pytest.mark.parametrize("droppable", [True, False])
def test_only_droppable_task_params_are_dropped(droppable: bool) -> None:
    exchange, taken = TaskExchange(), []
    params = {"w": torch.ones(1)}
    model = FLModel(params=params)
    exchange.put_task("train", model, droppable=droppable)
    _taker(exchange, 1.0, None, taken).join(5.0)

    exchange.drop_task_params()

    assert (model.params is None and params == {}) if droppable else model.params == {"w": torch.ones(1)}
