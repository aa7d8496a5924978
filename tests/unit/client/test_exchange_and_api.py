"""`TaskExchange` and the Client API functions, served by an `InProcessBackend` (no threads of the engine)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine import client as flare
from engine.client.backends import ENV_ENDPOINT, InProcessBackend, install_backend, installed_backend
from engine.client.exchange import TaskExchange, TaskItem
from engine.errors import ClientAPIError
from engine.model import FLModel

#: Longest a test waits for the other side of the exchange.
WAIT_S = 5.0


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


@pytest.fixture
def no_backend() -> Iterator[None]:
    """No backend installed, before and after the test."""
    install_backend(None)
    yield
    install_backend(None)


# ----------------------------------------------------------------------------- TaskExchange


def test_task_goes_to_the_script_and_result_comes_back(exchange: TaskExchange) -> None:
    model, answer = FLModel(params={"w": 1.0}), FLModel(params={"w": 2.0})

    exchange.put_task("train", model)
    item = exchange.take_task(WAIT_S)
    exchange.put_result(answer)
    result = exchange.take_result(WAIT_S)

    assert item == TaskItem("train", model)
    assert item.model is model
    assert result is answer
    assert exchange.current_task is None


def test_take_task_keeps_the_task_as_current_until_answered(exchange: TaskExchange) -> None:
    exchange.put_task("validate", FLModel())

    item = exchange.take_task(WAIT_S)

    assert exchange.current_task is item


def test_take_task_waits_for_a_task_put_from_another_thread(exchange: TaskExchange) -> None:
    putter = threading.Timer(0.05, exchange.put_task, args=("train", FLModel()))
    putter.start()

    item = exchange.take_task(WAIT_S)

    putter.join(WAIT_S)
    assert item is not None and item.task_name == "train"


@pytest.mark.parametrize(
    "wait",
    [
        pytest.param(lambda ex: ex.take_task(0.01), id="take_task"),
        pytest.param(lambda ex: ex.take_result(0.01), id="take_result"),
    ],
)
def test_waits_return_none_when_nothing_comes_in_time(exchange: TaskExchange, wait) -> None:
    assert wait(exchange) is None


def test_put_result_without_a_task_is_an_error(exchange: TaskExchange) -> None:
    with pytest.raises(ClientAPIError, match=r"send\(\) without a task: call receive\(\) first"):
        exchange.put_result(FLModel())


def test_one_result_per_task(exchange: TaskExchange) -> None:
    exchange.put_task("train", FLModel())
    exchange.take_task(WAIT_S)
    exchange.put_result(FLModel())

    with pytest.raises(ClientAPIError, match="without a task"):
        exchange.put_result(FLModel())


def test_end_wakes_a_waiting_script_with_none(exchange: TaskExchange) -> None:
    taken: list[TaskItem | None] = []
    script = threading.Thread(target=lambda: taken.append(exchange.take_task(WAIT_S)))
    script.start()

    exchange.end()
    script.join(WAIT_S)

    assert not script.is_alive()
    assert taken == [None]
    assert exchange.ended


def test_end_drops_an_offered_task(exchange: TaskExchange) -> None:
    exchange.put_task("train", FLModel())

    exchange.end()

    assert exchange.take_task(0.01) is None


def test_put_task_after_end_is_an_error(exchange: TaskExchange) -> None:
    exchange.end()

    with pytest.raises(ClientAPIError, match="has ended; no more tasks"):
        exchange.put_task("train", FLModel())


def test_take_result_after_end_returns_none_at_once(exchange: TaskExchange) -> None:
    exchange.end()

    assert exchange.take_result(WAIT_S) is None


def test_abandon_forgets_the_task_and_a_late_result(exchange: TaskExchange) -> None:
    exchange.put_task("train", FLModel())
    exchange.take_task(WAIT_S)
    exchange.put_result(FLModel())

    exchange.abandon()

    assert exchange.current_task is None
    assert exchange.take_result(0.01) is None
    with pytest.raises(ClientAPIError, match="without a task"):
        exchange.put_result(FLModel())


def test_abandon_drops_a_task_not_yet_taken(exchange: TaskExchange) -> None:
    exchange.put_task("train", FLModel())

    exchange.abandon()

    assert exchange.take_task(0.01) is None


# ----------------------------------------------------------------------------- Client API


def test_receive_returns_the_task_model(exchange: TaskExchange, backend: InProcessBackend) -> None:
    model = FLModel(params={"w": 1.0}, current_round=3)
    exchange.put_task("train", model)

    received = flare.receive(timeout=WAIT_S)

    assert received is model


def test_site_and_job_come_from_the_backend(backend: InProcessBackend) -> None:
    assert (flare.get_site_name(), flare.get_job_id()) == ("site-1", "job-7")


def test_task_name_is_none_before_the_first_task(backend: InProcessBackend) -> None:
    assert flare.get_task_name() is None
    assert not flare.is_train()
    assert not flare.is_evaluate()


@pytest.mark.parametrize(
    ("task_name", "is_train", "is_evaluate"),
    [
        pytest.param("train", True, False, id="train"),
        pytest.param("validate", False, True, id="validate"),
        pytest.param("evaluate", False, True, id="evaluate"),
        pytest.param("submit_model", False, False, id="other"),
    ],
)
def test_task_kind_follows_the_task_received_last(
    exchange: TaskExchange, backend: InProcessBackend, task_name: str, is_train: bool, is_evaluate: bool
) -> None:
    exchange.put_task(task_name, FLModel())
    flare.receive(timeout=WAIT_S)

    assert flare.get_task_name() == task_name
    assert flare.is_train() is is_train
    assert flare.is_evaluate() is is_evaluate


@pytest.mark.parametrize(
    ("clear_cache", "current_after_send"),
    [
        pytest.param(True, None, id="clear_cache"),
        pytest.param(False, "train", id="keep_cache"),
    ],
)
def test_send_delivers_the_result_and_clears_the_cache_when_asked(
    exchange: TaskExchange,
    backend: InProcessBackend,
    clear_cache: bool,
    current_after_send: str | None,
) -> None:
    exchange.put_task("train", FLModel(params={"w": 1.0}))
    flare.receive(timeout=WAIT_S)
    answer = FLModel(params={"w": 2.0}, meta={"NUM_STEPS_CURRENT_ROUND": 5})

    flare.send(answer, clear_cache=clear_cache)

    result = exchange.take_result(WAIT_S)
    # clear_cache hands the tensors over: the engine sends its own FLModel with them, the script's is emptied
    assert result is answer if not clear_cache else result.params == {"w": 2.0}
    assert flare.get_task_name() == current_after_send


def test_send_before_receive_is_an_error(backend: InProcessBackend) -> None:
    with pytest.raises(ClientAPIError, match=r"send\(\) without a task"):
        flare.send(FLModel())


def test_log_calls_on_log_with_the_current_task(exchange: TaskExchange, no_backend: None) -> None:
    logged: list[tuple[str, object, str | None]] = []
    install_backend(
        InProcessBackend(exchange, "site-1", "job", on_log=lambda k, v, task: logged.append((k, v, task.task_name)))
    )
    exchange.put_task("train", FLModel())
    flare.receive(timeout=WAIT_S)

    flare.log("loss", 0.5)

    assert logged == [("loss", 0.5, "train")]


def test_after_end_the_script_stops(exchange: TaskExchange, backend: InProcessBackend) -> None:
    assert flare.is_running()

    exchange.end()

    assert not flare.is_running()
    assert flare.receive(timeout=WAIT_S) is None
    assert flare.get_task_name() is None


def test_init_keeps_an_installed_backend(backend: InProcessBackend) -> None:
    flare.init()

    assert installed_backend() is backend


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: flare.receive(timeout=0.01), id="receive"),
        pytest.param(lambda: flare.send(FLModel()), id="send"),
        pytest.param(flare.is_running, id="is_running"),
        pytest.param(flare.get_site_name, id="get_site_name"),
        pytest.param(flare.get_job_id, id="get_job_id"),
        pytest.param(flare.get_task_name, id="get_task_name"),
        pytest.param(flare.is_train, id="is_train"),
        pytest.param(lambda: flare.log("loss", 1.0), id="log"),
    ],
)
def test_calls_before_init_are_errors(no_backend: None, call) -> None:
    with pytest.raises(ClientAPIError, match=r"not initialised: call flare\.init\(\) first"):
        call()


def test_init_outside_flengine_names_the_variable(no_backend: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_ENDPOINT, raising=False)

    with pytest.raises(ClientAPIError, match=f"{ENV_ENDPOINT} is not set"):
        flare.init()

    assert installed_backend() is None
