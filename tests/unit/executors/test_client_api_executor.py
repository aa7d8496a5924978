"""`ClientAPIExecutor` running tiny real training scripts written to a temp ``custom/`` folder."""

from __future__ import annotations

import re
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.client.backends import install_backend
from engine.errors import PathOutsideError
from engine.executors.client_api import REASON_HEADER, ClientAPIExecutor
from engine.executors.executor import ExecutorContext
from engine.model import (
    DXO,
    DataKind,
    FLModel,
    ReservedHeaderKey,
    ReturnCode,
    Shareable,
    model_from_shareable,
    shareable_from_model,
)

#: Adds 1 to every param, reports the round and its argv; writes is_running() once the run ends.
ECHO_SCRIPT = """
    import sys
    from engine import client as flare
    from engine.model import FLModel

    flare.init()
    while flare.is_running():
        model = flare.receive(timeout=10)
        if model is None:
            break
        flare.send(FLModel(
            params={k: v + 1 for k, v in model.params.items()},
            metrics={"round": model.current_round, "task": flare.get_task_name()},
            meta={"argv": sys.argv[1:]},
        ))
    with open("ended.txt", "w") as out:
        out.write(str(flare.is_running()))
"""
#: Takes every task and never answers, until the run ends.
SILENT_SCRIPT = """
    from engine import client as flare

    while flare.receive(timeout=10) is not None:
        pass
"""
RAISING_SCRIPT = """
    from engine import client as flare

    flare.receive(timeout=10)
    raise RuntimeError("boom in training")
"""
#: Longest a single task may take in these tests before something is wrong.
TASK_LIMIT_S = 5.0

MakeExecutor = Callable[..., ClientAPIExecutor]


@pytest.fixture
def context(tmp_path: Path) -> ExecutorContext:
    return ExecutorContext("site-1", "job-1", workspace=tmp_path, custom_dir=tmp_path)


@pytest.fixture
def make_executor(context: ExecutorContext, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeExecutor]:
    """Write a script to ``custom_dir``, start an executor on it; finalize it and uninstall its backend after."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the in-process runner sets the script's argv
    monkeypatch.chdir(context.workspace)  # an in-process script writes its files to the cwd
    started: list[ClientAPIExecutor] = []

    def make(script: str, name: str = "train.py", **kwargs) -> ClientAPIExecutor:
        (context.custom_dir / name).write_text(textwrap.dedent(script), encoding="utf-8")
        executor = ClientAPIExecutor(task_script_path=name, **kwargs)
        executor.initialize(context)
        started.append(executor)
        return executor

    yield make
    for executor in reversed(started):
        executor.finalize()
    install_backend(None)


def _run(executor: ClientAPIExecutor, task_name: str, task: Shareable, abort: threading.Event | None = None):
    """Execute one task; fail the test rather than hang when it takes longer than `TASK_LIMIT_S`."""
    started = time.monotonic()
    result = executor.execute(task_name, task, abort or threading.Event())
    assert time.monotonic() - started < TASK_LIMIT_S
    return result


def test_flmodel_task_gets_an_flmodel_result(make_executor: MakeExecutor) -> None:
    executor = make_executor(ECHO_SCRIPT)
    task = shareable_from_model(FLModel(params={"w": 1.0}, current_round=0))

    result = _run(executor, "train", task)

    assert result.get_return_code() is ReturnCode.OK
    model = model_from_shareable(result)
    assert model.params == {"w": 2.0}
    assert model.metrics == {"round": 0, "task": "train"}


def test_dxo_task_gets_a_dxo_result(make_executor: MakeExecutor) -> None:
    executor = make_executor(ECHO_SCRIPT)
    task = DXO(DataKind.WEIGHTS, {"w": 1.0, "b": 0.0}).to_shareable()

    result = _run(executor, "train", task)

    assert result.get_return_code() is ReturnCode.OK
    dxo = DXO.from_shareable(result)
    assert dxo.data_kind is DataKind.WEIGHTS
    assert dxo.data == {"w": 2.0, "b": 1.0}


def test_round_headers_reach_the_script(make_executor: MakeExecutor) -> None:
    executor = make_executor(ECHO_SCRIPT)
    task = DXO(DataKind.WEIGHTS, {"w": 1.0}).to_shareable()
    task.set_header(ReservedHeaderKey.CURRENT_ROUND, 4)

    result = _run(executor, "train", task)

    assert DXO.from_shareable(result).meta["metrics"]["round"] == 4


def test_script_answers_task_after_task(make_executor: MakeExecutor) -> None:
    executor = make_executor(ECHO_SCRIPT)

    results = [_run(executor, name, shareable_from_model(FLModel(params={"w": 1.0}))) for name in ("train", "validate")]

    assert [model_from_shareable(r).metrics["task"] for r in results] == ["train", "validate"]


def test_script_args_reach_sys_argv(make_executor: MakeExecutor) -> None:
    executor = make_executor(ECHO_SCRIPT, task_script_args="--epochs 2 --name 'site one'")

    result = _run(executor, "train", shareable_from_model(FLModel(params={"w": 1.0})))

    assert model_from_shareable(result).meta["argv"] == ["--epochs", "2", "--name", "site one"]


def test_raising_script_fails_this_task_and_the_next_at_once(make_executor: MakeExecutor) -> None:
    executor = make_executor(RAISING_SCRIPT, name="bad.py")

    first = _run(executor, "train", shareable_from_model(FLModel(params={"w": 1.0})))
    started = time.monotonic()
    second = executor.execute("train", shareable_from_model(FLModel(params={"w": 1.0})), threading.Event())

    assert time.monotonic() - started < 0.1
    for result in (first, second):
        assert result.get_return_code() is ReturnCode.EXECUTION_EXCEPTION
        assert result.get_header(REASON_HEADER) == "bad.py raised RuntimeError: boom in training"


def test_script_that_ends_without_answering_fails_the_task(make_executor: MakeExecutor) -> None:
    executor = make_executor("print('nothing to do')\n", name="quits.py")

    result = _run(executor, "train", shareable_from_model(FLModel(params={"w": 1.0})))

    assert result.get_return_code() is ReturnCode.EXECUTION_EXCEPTION
    assert result.get_header(REASON_HEADER) == "quits.py ended before answering the task"


def test_task_without_a_model_is_bad_task_data(make_executor: MakeExecutor) -> None:
    executor = make_executor(ECHO_SCRIPT)

    result = _run(executor, "train", Shareable())

    assert result.get_return_code() is ReturnCode.BAD_TASK_DATA
    assert "carries no DXO" in result.get_header(REASON_HEADER)


def test_task_timeout_is_honoured(make_executor: MakeExecutor) -> None:
    executor = make_executor(SILENT_SCRIPT, task_timeout_s=0.3)
    started = time.monotonic()

    result = executor.execute("train", shareable_from_model(FLModel(params={"w": 1.0})), threading.Event())

    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 2.0
    assert result.get_return_code() is ReturnCode.EXECUTION_EXCEPTION
    assert result.get_header(REASON_HEADER) == "the script returned no result within task_timeout_s=0.3"


#: Answers its first task late (after 0.6 s) and then writes late_send.done; every later one at once.
LATE_ONCE_SCRIPT = """
    import time
    from engine import client as flare
    from engine.model import FLModel

    first = True
    while (model := flare.receive(timeout=10)) is not None:
        if not first:
            flare.send(FLModel(params=model.params))
            continue
        first = False
        time.sleep(0.6)
        try:
            flare.send(FLModel(params=model.params))
        finally:
            open("late_send.done", "w").close()
"""


def _wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout_s} s"
        time.sleep(0.02)


def test_a_late_result_does_not_fail_the_next_task(make_executor: MakeExecutor, tmp_path: Path) -> None:
    executor = make_executor(LATE_ONCE_SCRIPT, task_timeout_s=0.3)
    late = _run(executor, "train", shareable_from_model(FLModel(params={"w": 1.0})))
    _wait_for_file(tmp_path / "late_send.done", TASK_LIMIT_S)

    result = _run(executor, "train", shareable_from_model(FLModel(params={"w": 1.0})))

    assert late.get_return_code() is ReturnCode.EXECUTION_EXCEPTION
    assert result.get_return_code() is ReturnCode.OK, result.get_header(REASON_HEADER)


@pytest.mark.parametrize(
    "set_after_s",
    [pytest.param(None, id="set_before"), pytest.param(0.1, id="set_while_running")],
)
def test_abort_signal_aborts_the_task(make_executor: MakeExecutor, set_after_s: float | None) -> None:
    executor = make_executor(SILENT_SCRIPT)
    abort = threading.Event()
    if set_after_s is None:
        abort.set()
    setter = threading.Timer(set_after_s or 0.0, abort.set)
    setter.start()

    result = _run(executor, "train", shareable_from_model(FLModel(params={"w": 1.0})), abort)

    setter.join(TASK_LIMIT_S)

    assert result.get_return_code() is ReturnCode.TASK_ABORTED
    assert result.get_header(REASON_HEADER) == "the task was aborted"


def test_finalize_ends_the_script(make_executor: MakeExecutor, tmp_path: Path) -> None:
    executor = make_executor(ECHO_SCRIPT)
    _run(executor, "train", shareable_from_model(FLModel(params={"w": 1.0})))

    executor.finalize()

    assert (tmp_path / "ended.txt").read_text() == "False"


#: Answers every task with its own name, so a test sees which script answered.
NAMED_SCRIPT = """
    import os
    from engine import client as flare
    from engine.model import FLModel

    while (model := flare.receive(timeout=10)) is not None:
        flare.send(FLModel(metrics={"script": os.path.basename(__file__)}))
"""


def test_two_in_process_executors_each_serve_their_own_script(make_executor: MakeExecutor) -> None:
    trainer = make_executor(NAMED_SCRIPT, name="trainer.py", task_timeout_s=1.0)
    validator = make_executor(NAMED_SCRIPT, name="validator.py", task_timeout_s=1.0)
    steps = [(trainer, "train"), (validator, "validate"), (trainer, "train")]

    results = [_run(executor, name, shareable_from_model(FLModel(params={"w": 1.0}))) for executor, name in steps]

    assert [r.get_return_code() for r in results] == [ReturnCode.OK] * 3
    assert [model_from_shareable(r).metrics["script"] for r in results] == ["trainer.py", "validator.py", "trainer.py"]


def test_execute_before_initialize_fails_the_task() -> None:
    executor = ClientAPIExecutor(task_script_path="train.py")

    result = executor.execute("train", shareable_from_model(FLModel()), threading.Event())

    assert result.get_return_code() is ReturnCode.EXECUTION_EXCEPTION
    assert result.get_header(REASON_HEADER) == "the executor was not initialised"


def test_missing_script_names_task_script_path(context: ExecutorContext) -> None:
    executor = ClientAPIExecutor(task_script_path="nope.py")

    with pytest.raises(FileNotFoundError, match=r"task_script_path: 'nope.py' not found .*custom/ folder"):
        executor.initialize(context)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"execution_mode": "thread"},
            "execution_mode: expected 'in_process' or 'subprocess', got 'thread'",
            id="execution_mode",
        ),
        pytest.param({"task_timeout_s": -1}, "task_timeout_s: expected seconds >= 0, got -1", id="task_timeout_s"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClientAPIExecutor(task_script_path="train.py", **kwargs)


def test_subprocess_mode_runs_the_script_as_a_process(make_executor: MakeExecutor, tmp_path: Path) -> None:
    executor = make_executor(ECHO_SCRIPT, execution_mode="subprocess", task_timeout_s=30.0)
    task = shareable_from_model(FLModel(params={"w": 1.0}, current_round=1))

    result = executor.execute("train", task, threading.Event())
    executor.finalize()

    assert result.get_return_code() is ReturnCode.OK, result.get_header(REASON_HEADER)
    model = model_from_shareable(result)
    assert model.params == {"w": 2.0}
    assert model.metrics == {"round": 1, "task": "train"}
    assert (tmp_path / "ended.txt").read_text() == "False"  # the script saw the run end


@pytest.mark.parametrize(
    "script", ["../outside.py", "/etc/hostname", "link.py"], ids=["dot-dot", "absolute", "symlink-out"]
)
def test_a_script_outside_the_custom_folder_is_refused(context: ExecutorContext, tmp_path: Path, script: str) -> None:
    outside = tmp_path.parent / "outside.py"
    outside.write_text("print('not the job')\n")
    (tmp_path / "link.py").symlink_to(outside)
    executor = ClientAPIExecutor(task_script_path=script)

    with pytest.raises(
        PathOutsideError,
        match=rf"task_script_path: '{re.escape(script)}' leads to .*, outside the app's custom/ folder",
    ):
        executor.initialize(context)
