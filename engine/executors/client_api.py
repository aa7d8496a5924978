"""`ClientAPIExecutor`: runs a training script that uses the Client API, in a thread or a process."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import runpy
import shlex
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Literal

from engine.cells import Message, Reply, Status
from engine.client.backends import (
    API_CHANNEL,
    ENV_ENDPOINT,
    ENV_JOB,
    ENV_SITE,
    ENV_STREAMING,
    TOPIC_LOG,
    TOPIC_RECEIVE,
    TOPIC_SEND,
    InProcessBackend,
    install_backend,
)
from engine.client.exchange import TaskExchange
from engine.executors.executor import Executor, ExecutorContext
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
from engine.site import SiteEndpoint
from engine.streaming.lazy import LazyRef

log = logging.getLogger(__name__)

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
    ) -> None:
        if execution_mode not in ("in_process", "subprocess"):
            raise ValueError(f"execution_mode: expected 'in_process' or 'subprocess', got {execution_mode!r}")
        if task_timeout_s < 0:
            raise ValueError(f"task_timeout_s: expected seconds >= 0, got {task_timeout_s}")
        self.task_script_path = task_script_path
        self.task_script_args = shlex.split(task_script_args)
        self.execution_mode = execution_mode
        self.task_timeout_s = task_timeout_s
        self._exchange = TaskExchange()
        self._failure: str | None = None
        self._runner: _ScriptRunner | None = None
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
        runner_type = _ThreadRunner if self.execution_mode == "in_process" else _ProcessRunner
        self._runner = runner_type(script, self.task_script_args, self._exchange, context)
        self._runner.start()

    def execute(self, task_name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        """Hand the task to the script and return its result; tasks from several threads take turns."""
        with self._one_task_at_a_time:
            return self._execute(task_name, shareable, abort_signal)

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
        self._exchange.put_task(task_name, model)
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


class _ScriptRunner(ABC):
    """Runs the script and says whether it is still able to answer tasks."""

    def __init__(self, script: Path, args: list[str], exchange: TaskExchange, context: ExecutorContext) -> None:
        self.script = script
        self.args = args
        self.exchange = exchange
        self.context = context
        self.metrics_file = context.workspace / "metrics.jsonl"

    @abstractmethod
    def start(self) -> None:
        """Start the script."""

    @abstractmethod
    def failure(self) -> str | None:
        """Why the script can no longer answer tasks, or None while it can."""

    @abstractmethod
    def stop(self, grace_s: float) -> None:
        """Let the script end within ``grace_s`` seconds, then make it."""

    def record_metric(self, key: str, value: Any, task_name: str | None, current_round: Any) -> None:
        line = {"site": self.context.site_name, "task": task_name, "round": current_round, "key": key, "value": value}
        with self.metrics_file.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line, default=str) + "\n")


class _ThreadRunner(_ScriptRunner):
    """``in_process``: the script runs in a thread, its Client API calls go to the exchange."""

    def start(self) -> None:
        self._error: str | None = None
        self._finished = False
        backend = InProcessBackend(
            self.exchange,
            self.context.site_name,
            self.context.job_id,
            on_log=lambda key, value, task: self.record_metric(
                key, value, task.task_name if task else None, task.model.current_round if task else None
            ),
        )
        self._backend = backend
        self._thread = threading.Thread(target=self._run, name=f"script-{self.script.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        install_backend(self._backend, this_thread_only=True)
        # sys.argv is process-wide: two in_process scripts of one client may read each other's
        # arguments at start-up; give such a job subprocess mode.
        sys.argv = [str(self.script), *self.args]
        try:
            runpy.run_path(str(self.script), run_name="__main__")
        except BaseException as e:  # the script's own error: report it, keep the client alive
            self._error = f"{self.script.name} raised {type(e).__name__}: {e}"
            log.exception("training script failed script=%s", self.script)
        finally:
            self._finished = True

    def failure(self) -> str | None:
        if self._error is not None:
            return self._error
        if self._finished:
            return f"{self.script.name} ended before answering the task"
        return None

    def stop(self, grace_s: float) -> None:
        self._thread.join(grace_s)
        if self._thread.is_alive():
            log.warning("training script still running after the job ended script=%s", self.script)


class _ProcessRunner(_ScriptRunner):
    """``subprocess``: the script is its own process; a local cell serves its Client API calls."""

    def start(self) -> None:
        site = self.context.site_name
        streaming = self.context.streaming
        # The script's link is as secure as the client job's own (CURVE unless insecure = true).
        secure = self.context.cell is None or self.context.cell.secure
        self._endpoint, credentials = SiteEndpoint.for_script_host(
            site, streaming, secure=secure, workspace=self.context.workspace
        )
        self._cell = self._endpoint.cell
        self._endpoint.start()
        self._codec = self._endpoint.codec
        self._cell.register_handler(API_CHANNEL, TOPIC_RECEIVE, self._on_receive)
        self._cell.register_handler(API_CHANNEL, TOPIC_SEND, self._on_send)
        self._cell.register_handler(API_CHANNEL, TOPIC_LOG, self._on_log)
        env = dict(os.environ)
        paths = [str(self.context.custom_dir)] if self.context.custom_dir else []
        env["PYTHONPATH"] = os.pathsep.join([*paths, *sys.path[1:]])
        env.update(
            {
                ENV_ENDPOINT: self._cell.endpoint,
                ENV_SITE: site,
                ENV_JOB: self.context.job_id,
                ENV_STREAMING: json.dumps(streaming),
                **(credentials.to_environment() if credentials is not None else {}),
            }
        )
        self._process = subprocess.Popen(
            [sys.executable, str(self.script), *self.args], env=env, cwd=self.context.workspace
        )
        log.info("training script started pid=%d script=%s", self._process.pid, self.script)

    def failure(self) -> str | None:
        code = self._process.poll()
        if code is None:
            return None
        return f"{self.script.name} exited with code {code} before answering the task"

    def stop(self, grace_s: float) -> None:
        try:
            self._process.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("training script did not end; terminating it pid=%d", self._process.pid)
            self._process.terminate()
            try:
                self._process.wait(5.0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._endpoint.close()

    def _on_receive(self, message: Message) -> Reply:
        wait_s = min(float(message.header.get("wait_s", 2.0)), 10.0)
        if self.exchange.ended:
            return Reply(header={"state": "end"})
        task = self.exchange.take_task(wait_s)
        if task is None:
            return Reply(header={"state": "end" if self.exchange.ended else "wait"})
        frames = self._codec.encode(task.model, receivers=[message.source])
        return Reply(header={"state": "task", "task_name": task.task_name}, frames=frames)

    def _on_send(self, message: Message) -> Reply:
        try:
            model = self._codec.decode(message.frames, sender=message.source)
            if not isinstance(model, FLModel):
                raise TypeError(f"send() takes an FLModel, got {type(model).__name__}")
            self.exchange.put_result(model)
        except Exception as e:  # answered, never raised into the cell
            log.warning("bad result from the training script: %s", e)
            return Reply(header={"error": str(e)}, status=Status.OK)
        return Reply(header={})

    def _on_log(self, message: Message) -> Reply:
        current = self.exchange.current_task
        self.record_metric(
            str(message.header.get("key")),
            message.header.get("value"),
            current.task_name if current else None,
            current.model.current_round if current else None,
        )
        return Reply(header={})
