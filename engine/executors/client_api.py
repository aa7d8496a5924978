"""`ClientAPIExecutor`: runs a training script that uses the Client API, in a thread or a process."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import shlex
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from engine.client.exchange import TaskExchange
from engine.client.into import placement_of
from engine.executors.executor import Executor, ExecutorContext, is_handed_over
from engine.executors.launch import parse_command, resolve_command
from engine.executors.script_runners import ProcessRunner, ScriptRunner, ThreadRunner
from engine.model import (
    FLModel,
    ReservedHeaderKey,
    ReturnCode,
    Shareable,
    carries_model,
    dxo_from_model,
    make_reply,
    model_from_shareable,
    shareable_from_model,
)
from engine.paths import JobPaths, path_inside
from engine.streaming.codec import Placement
from engine.streaming.lazy import LazyRef

#: Seconds between checks of the abort signal and the script's health while a task runs.
_POLL_S = 0.2
#: Seconds a script gets to return after the run ended before it is stopped.
_STOP_GRACE_S = 10.0
#: Header of a failed result: why it failed.
REASON_HEADER = "reason"


class ClientAPIExecutor(Executor):
    """Runs ``task_script_path`` once and hands it every task through the Client API.

    Args:
        task_script_path: The script, relative to the app's ``custom/`` folder, which it must not
            leave (symlinks are followed; ``..`` and absolute paths elsewhere are refused, by
            `use_job_paths` at job start where the runtime calls it, and always by `initialize`,
            before the first task).
        task_script_args: Its command-line arguments, split like a shell would
            (``"--epochs 1 --lr 0.01"``); the script sees them in ``sys.argv``.
        execution_mode: ``in_process``: a thread of the client process (shares its memory, no
            copy of the model); ``subprocess``: its own Python process, the model pulled over a
            local cell (the script's crash cannot take the client down).
        task_timeout_s: Longest time a task may take in the script; 0 = no limit.
        command: ``subprocess`` only: the program (and its arguments) the script's path and
            ``task_script_args`` are appended to; a string split like a shell would
            (``"torchrun --standalone --nproc_per_node 2"``) or a list, never run by a shell
            (shell metacharacters are refused). ``python``/``python3`` is the client's own
            interpreter and ``torchrun`` its ``python -m torch.distributed.run``; another program
            must be an absolute path or on ``PATH``. Empty (the default): ``python``. Under
            torchrun only rank 0 talks to the executor; see `engine.client.distributed`.

    The script's result goes back the way the task came: an `FLModel` for FedAvg, a DXO for
    ScatterAndGather. A script that raises fails its task (and every later one) with
    ``EXECUTION_EXCEPTION`` and the error as the reason.
    """

    #: Args that name a file in the app's custom/ folder: `flengine validate` checks they exist.
    CUSTOM_FILE_ARGS: ClassVar[tuple[str, ...]] = ("task_script_path",)

    def __init__(
        self,
        task_script_path: str,
        task_script_args: str = "",
        execution_mode: Literal["in_process", "subprocess"] = "in_process",
        task_timeout_s: float = 0.0,
        command: str | list[str] = "",
    ) -> None:
        if execution_mode not in ("in_process", "subprocess"):
            raise ValueError(f"execution_mode: expected 'in_process' or 'subprocess', got {execution_mode!r}")
        if task_timeout_s < 0:
            raise ValueError(f"task_timeout_s: expected seconds >= 0, got {task_timeout_s}")
        self.command = parse_command(command)
        if self.command and execution_mode != "subprocess":
            raise ValueError(
                f"command: {command!r} launches the script as its own process; set execution_mode = subprocess"
            )
        self.task_script_path = task_script_path
        self.task_script_args = shlex.split(task_script_args)
        self.execution_mode = execution_mode
        self.task_timeout_s = task_timeout_s
        self._exchange = TaskExchange()
        self._failure: str | None = None
        self._runner: ScriptRunner | None = None
        self._one_task_at_a_time = threading.Lock()

    def use_job_paths(self, paths: JobPaths) -> None:
        """Check ``task_script_path`` against the app's ``custom/`` folder (the runtime calls it at job start).

        Raises:
            PathOutsideError: The script (symlinks resolved) lies outside ``custom/``; the message
                names ``task_script_path``.
        """
        _script_in(paths.custom_dir, self.task_script_path)

    def initialize(self, context: ExecutorContext) -> None:
        script = Path(self.task_script_path)
        if context.custom_dir is not None:  # a job's script stays in its custom/ folder, symlinks included
            script = _script_in(context.custom_dir, self.task_script_path)
        if not script.is_file():
            raise FileNotFoundError(
                f"task_script_path: {self.task_script_path!r} not found (looked for {script}); "
                "put the script in the app's custom/ folder"
            )
        if self.execution_mode == "in_process":
            self._runner = ThreadRunner(script, self.task_script_args, self._exchange, context)
        else:
            argv = resolve_command(self.command)
            self._runner = ProcessRunner(script, self.task_script_args, self._exchange, context, argv)
        self._runner.start()

    def execute(self, task_name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        """Hand the task to the script and return its result; tasks from several threads take turns."""
        with self._one_task_at_a_time:
            try:
                return self._execute(task_name, shareable, abort_signal)
            finally:
                self._exchange.release_claim()  # a task that never reached the script frees its wait

    @contextlib.contextmanager
    def task_data_placement(self, task_name: str, abort_signal: threading.Event) -> Iterator[Placement | None]:
        """The script's own tensors, when it waits in ``flare.receive(into=...)`` (``in_process``).

        Waits until the script asks for the next task (at most half the job's
        ``streaming_per_request_timeout``, after which the server would drop the offer): the
        task's tensors are pulled when the script wants them, into its own tensors if it says
        so; otherwise into new memory. ``subprocess`` scripts pull into theirs themselves.
        """
        targets = self._script_targets(abort_signal) if self.execution_mode == "in_process" else None
        if targets is None:
            yield None
            return
        try:
            yield functools.partial(placement_of, targets=targets)
        except BaseException:
            self._exchange.release_claim()
            raise

    def _script_targets(self, abort_signal: threading.Event) -> dict[str, Any] | None:
        if self._runner is None:
            return None
        timeout_s = float(self._runner.context.streaming.get("streaming_per_request_timeout", 600.0)) / 2
        deadline = time.monotonic() + timeout_s
        while not abort_signal.is_set() and self._runner.failure() is None and time.monotonic() < deadline:
            waiting, targets = self._exchange.claim_taker(_POLL_S)
            if waiting:
                return targets
        return None

    def _execute(self, task_name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        if self._runner is None:
            return _failed(ReturnCode.EXECUTION_EXCEPTION, "the executor was not initialised")
        problem = self._runner.failure()
        if problem is not None:
            return _failed(ReturnCode.EXECUTION_EXCEPTION, problem)
        try:
            model = _task_model(shareable)
        except ValueError as e:
            return _failed(ReturnCode.BAD_TASK_DATA, str(e))
        # A subprocess script gets its own copy: the executor's one may go once it asks to send.
        droppable = self.execution_mode == "subprocess" and is_handed_over(shareable)
        self._exchange.put_task(task_name, model, droppable=droppable)
        del model
        result = self._wait_result(abort_signal)
        if isinstance(result, str):
            self._exchange.abandon()
            return _failed(ReturnCode.TASK_ABORTED if abort_signal.is_set() else ReturnCode.EXECUTION_EXCEPTION, result)
        reply = shareable_from_model(result) if carries_model(shareable) else dxo_from_model(result).to_shareable()
        reply.set_return_code(ReturnCode.OK)
        return reply

    def finalize(self) -> None:
        self._exchange.end()
        if self._runner is not None:
            self._runner.stop(_STOP_GRACE_S)

    def _wait_result(self, abort_signal: threading.Event) -> FLModel | str:
        """The script's result, or why there is none."""
        deadline = time.monotonic() + self.task_timeout_s if self.task_timeout_s > 0 else None
        while True:
            result = self._exchange.take_result(_POLL_S)
            if result is not None:
                return result
            if abort_signal.is_set():
                return "the task was aborted"
            problem = self._runner.failure() if self._runner is not None else "no script"
            if problem is not None:
                return problem
            if deadline is not None and time.monotonic() > deadline:
                return f"the script returned no result within task_timeout_s={self.task_timeout_s}"


def _script_in(custom_dir: Path, task_script_path: str) -> Path:
    """``task_script_path`` resolved in ``custom_dir``; `PathOutsideError` if it leads out."""
    return path_inside(custom_dir, task_script_path, "task_script_path", "the app's custom/ folder")


def _task_model(shareable: Shareable) -> FLModel:
    """The task's model as the script gets it: tensors in memory, even where they came to disk."""
    model = model_from_shareable(shareable)
    if model.params and any(isinstance(value, LazyRef) for value in model.params.values()):
        # Read one tensor at a time into a new dict: the task data keeps its lazy refs (and its
        # files) for whoever else holds them, e.g. a Swarm aggregator's copy of the round's model.
        params = {
            name: value.resolve() if isinstance(value, LazyRef) else value for name, value in model.params.items()
        }
        model = dataclasses.replace(model, params=params)
    if model.current_round is None:
        model.current_round = shareable.get_header(ReservedHeaderKey.CURRENT_ROUND)
    if model.total_rounds is None:
        model.total_rounds = shareable.get_header(ReservedHeaderKey.TOTAL_ROUNDS)
    return model


def _failed(code: ReturnCode, reason: str) -> Shareable:
    reply = make_reply(code)
    reply.set_header(REASON_HEADER, reason)
    return reply
