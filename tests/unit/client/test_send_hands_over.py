"""``flare.send(model)`` hands the params over (``clear_cache=True``): the script's FLModels let go."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine import client as flare
from engine.client.backends import InProcessBackend, install_backend
from engine.client.exchange import TaskExchange
from engine.client.handover import HANDED_OVER, HandedOverParams, hand_over
from engine.errors import ClientAPIError, FlengineError, ParamsHandedOverError
from engine.model import FLModel

#: Longest a test waits for the other side of the exchange.
WAIT_S = 5.0
HANDED = r"handed to the engine by flare\.send\(\.\.\., clear_cache=True\); keep a copy before send"


@pytest.fixture
def exchange() -> TaskExchange:
    return TaskExchange()


@pytest.fixture
def backend(exchange: TaskExchange) -> Iterator[InProcessBackend]:
    """An `InProcessBackend` on ``exchange``, installed for the Client API and removed afterwards."""
    installed = InProcessBackend(exchange, "site-1", "job-7")
    install_backend(installed)
    yield installed
    install_backend(None)


def _task(exchange: TaskExchange) -> FLModel:
    """Offer a task with two tensors and receive it as the script would."""
    exchange.put_task("train", FLModel(params={"w": torch.ones(4), "b": torch.zeros(2)}))
    received = flare.receive(timeout=WAIT_S)
    assert received is not None
    return received


# ----------------------------------------------------------------------------- the stand-in


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda p: p["w"], id="getitem"),
        pytest.param(lambda p: list(p), id="iter"),
        pytest.param(len, id="len"),
        pytest.param(lambda p: "w" in p, id="contains"),
        pytest.param(bool, id="bool"),
        pytest.param(lambda p: p.items(), id="items"),
        pytest.param(lambda p: p.values(), id="values"),
        pytest.param(lambda p: p.keys(), id="keys"),
        pytest.param(lambda p: p.get("w"), id="get"),
        pytest.param(lambda p: p.copy(), id="dict_method"),
        pytest.param(lambda p: p == {}, id="eq"),
        pytest.param(dict, id="dict"),
        pytest.param(lambda p: torch.nn.Linear(1, 1).load_state_dict(p), id="load_state_dict"),
    ],
)
def test_every_read_of_handed_over_params_is_the_clear_error(read: Callable[[Any], Any]) -> None:
    with pytest.raises(ParamsHandedOverError, match=HANDED) as raised:
        read(HANDED_OVER)

    assert isinstance(raised.value, FlengineError)
    assert isinstance(raised.value, ClientAPIError)


def test_handed_over_params_can_still_be_shown_and_copied() -> None:
    model = FLModel(params=HANDED_OVER)

    assert "handed to the engine by flare.send()" in repr(model)
    assert isinstance(copy.deepcopy(model).params, HandedOverParams)


# ----------------------------------------------------------------------------- hand_over


def test_hand_over_empties_a_received_model_whose_dict_was_sent() -> None:
    received = FLModel(params={"w": torch.ones(2)})
    sent = FLModel(params=received.params)

    hand_over(sent, received)

    assert sent.params is HANDED_OVER
    assert received.params is HANDED_OVER


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda params: dict(params), id="same_tensors_new_dict"),
        pytest.param(lambda params: {k: t.detach() for k, t in params.items()}, id="views_of_them"),
    ],
)
def test_hand_over_empties_a_received_model_that_shares_tensors(build: Callable[[dict], dict]) -> None:
    received = FLModel(params={"w": torch.ones(2), "b": torch.ones(1)})
    sent = FLModel(params=build(received.params))

    hand_over(sent, received)

    assert received.params is HANDED_OVER


def test_hand_over_leaves_a_received_model_that_shares_nothing() -> None:
    mine = {"w": torch.ones(2)}
    received = FLModel(params=mine)
    sent = FLModel(params={"w": torch.ones(2)})

    hand_over(sent, received)

    assert sent.params is HANDED_OVER
    assert received.params is mine


def test_hand_over_of_a_model_without_params_changes_nothing() -> None:
    received = FLModel(params={"w": torch.ones(2)})
    sent = FLModel(metrics={"accuracy": 0.5})

    hand_over(sent, received)

    assert sent.params is None
    assert isinstance(received.params, dict)


# ----------------------------------------------------------------------------- flare.send


def test_send_hands_the_sent_and_the_received_params_over(exchange: TaskExchange, backend: InProcessBackend) -> None:
    received = _task(exchange)
    tensors = dict(received.params)

    flare.send(FLModel(params=received.params, meta={"NUM_STEPS_CURRENT_ROUND": 3}))
    result = exchange.take_result(WAIT_S)

    with pytest.raises(ParamsHandedOverError, match=HANDED):
        received.params["w"]
    assert result is not None
    assert result.params.keys() == tensors.keys()
    assert all(result.params[name] is tensor for name, tensor in tensors.items())
    assert result.meta == {"NUM_STEPS_CURRENT_ROUND": 3}


def test_reading_the_sent_model_after_send_is_the_clear_error(
    exchange: TaskExchange, backend: InProcessBackend
) -> None:
    received = _task(exchange)
    sent = FLModel(params={name: t + 1 for name, t in received.params.items()})

    flare.send(sent)

    with pytest.raises(ParamsHandedOverError, match=HANDED):
        sent.params.items()
    assert isinstance(received.params, dict)  # nothing of it was sent: the script keeps it


def test_tensors_are_freed_once_the_engine_lets_go(exchange: TaskExchange, backend: InProcessBackend) -> None:
    received = _task(exchange)
    watched = weakref.ref(received.params["w"])

    flare.send(FLModel(params=received.params))
    result = exchange.take_result(WAIT_S)
    assert watched() is not None  # served until pulled: the engine still holds it
    del result  # what the runtime does once the server has pulled the result
    gc.collect()

    assert watched() is None  # although the script still holds `received`


def test_clear_cache_false_keeps_both_models(exchange: TaskExchange, backend: InProcessBackend) -> None:
    received = _task(exchange)
    params = received.params
    sent = FLModel(params=params)

    flare.send(sent, clear_cache=False)

    assert exchange.take_result(WAIT_S) is sent
    assert sent.params is params
    assert received.params is params
    assert flare.get_task_name() == "train"


def test_sending_handed_over_params_again_is_the_clear_error(exchange: TaskExchange, backend: InProcessBackend) -> None:
    first = _task(exchange)
    flare.send(FLModel(params=first.params))
    exchange.take_result(WAIT_S)
    _task(exchange)

    with pytest.raises(ParamsHandedOverError, match=HANDED):
        flare.send(first)
    assert exchange.take_result(0.01) is None


def test_sending_the_received_model_itself_hands_it_over(exchange: TaskExchange, backend: InProcessBackend) -> None:
    received = _task(exchange)
    received.meta["NUM_STEPS_CURRENT_ROUND"] = 1

    flare.send(received)
    result = exchange.take_result(WAIT_S)

    assert received.params is HANDED_OVER
    assert result is not None and set(result.params) == {"w", "b"}
