"""How `ClientAPIExecutor` runs its training script: in a thread (`ThreadRunner`) or a process (`ProcessRunner`).

A runner starts the script, says whether it can still answer tasks, stops it at the end of the
job, and records the metrics the script logs. The tasks themselves pass through the executor's
`TaskExchange`: a thread's Client API calls reach it directly, a process's through a local cell.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from engine.cells import Message, Reply, Status
from engine.client.backends import (
    API_CHANNEL,
    ENV_ENDPOINT,
    ENV_JOB,
    ENV_SITE,
    ENV_STATE_DIR,
    ENV_STREAMING,
    TOPIC_LOG,
    TOPIC_RECEIVE,
    TOPIC_SEND,
    InProcessBackend,
    install_backend,
    job_sites_to_environment,
)
from engine.client.exchange import TaskExchange
from engine.client.state import STATE_FOLDER
from engine.executors.executor import ExecutorContext
from engine.executors.launch import StderrTail, script_environment
from engine.model import FLModel, shown_round
from engine.site import SiteEndpoint
from engine.site.endpoint import SCRIPT_CELL_SUFFIX

log = logging.getLogger(__name__)


class ScriptRunner(ABC):
    """Runs the script and says whether it is still able to answer tasks.

    Args:
        script: The training script (already checked to lie in the app's ``custom/`` folder).
        args: Its command-line arguments (``sys.argv[1:]``).
        exchange: Where the executor puts tasks and the script's Client API takes them.
        context: The executor's site, job, workspace (``metrics.jsonl`` goes there) and streaming settings.
        command: `ProcessRunner` only: the program the script's path and ``args`` follow
            (default: this interpreter).
    """

    def __init__(
        self,
        script: Path,
        args: list[str],
        exchange: TaskExchange,
        context: ExecutorContext,
        command: list[str] | None = None,
    ) -> None:
        self.script = script
        self.args = args
        self.command = command or [sys.executable]
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
        """Append the metric to this site's ``metrics.jsonl``, and send it to the server (numbers only)."""
        line = {
            "site": self.context.site_name,
            "task": task_name,
            "round": shown_round(current_round),
            "key": key,
            "value": value,
        }
        with self.metrics_file.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line, default=str) + "\n")
        if self.context.report_metric is not None:  # the server checks and limits what it gets
            self.context.report_metric(key, value, current_round)


class ThreadRunner(ScriptRunner):
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
            job_sites=self.context.job_sites,
            state_dir=self.context.workspace / STATE_FOLDER,
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


class ProcessRunner(ScriptRunner):
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
        # Only the script's own cell is answered (under torchrun: rank 0's; the others never connect).
        self._script_cell = f"{site}.{SCRIPT_CELL_SUFFIX}"
        self._cell.register_handler(API_CHANNEL, TOPIC_RECEIVE, self._only_script(self._on_receive))
        self._cell.register_handler(API_CHANNEL, TOPIC_SEND, self._only_script(self._on_send))
        self._cell.register_handler(API_CHANNEL, TOPIC_LOG, self._only_script(self._on_log))
        env = script_environment(dict(os.environ))
        paths = [str(self.context.custom_dir)] if self.context.custom_dir else []
        env["PYTHONPATH"] = os.pathsep.join([*paths, *sys.path[1:]])
        env.update(
            {
                ENV_ENDPOINT: self._cell.endpoint,
                ENV_SITE: site,
                ENV_JOB: self.context.job_id,
                ENV_STREAMING: json.dumps(streaming),
                **job_sites_to_environment(self.context.job_sites),
                ENV_STATE_DIR: str(self.context.workspace / STATE_FOLDER),
                **(credentials.to_environment() if credentials is not None else {}),
            }
        )
        # Its own session: a launcher's workers (torchrun's ranks) are stopped with it, as a group.
        self._process = subprocess.Popen(
            [*self.command, str(self.script), *self.args],
            env=env,
            cwd=self.context.workspace,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._stderr = StderrTail()
        assert self._process.stderr is not None
        self._stderr.follow(self._process.stderr, name=f"stderr-{self.script.name}")
        log.info("training script started pid=%d script=%s command=%s", self._process.pid, self.script, self.command)

    def failure(self) -> str | None:
        code = self._process.poll()
        if code is None:
            return None
        self._stderr.wait(2.0)  # its last lines are the ones that say why
        return f"{self.script.name} exited with code {code} before answering the task; {self._stderr.summary()}"

    def stop(self, grace_s: float) -> None:
        try:
            self._process.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("training script did not end; terminating it pid=%d", self._process.pid)
            self._signal_group(signal.SIGTERM)
            try:
                self._process.wait(5.0)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._process.wait()
        self._stderr.wait(2.0)
        self._endpoint.close()

    def _signal_group(self, signum: int) -> None:
        """Signal the script's process group (its session), the launcher and every worker it started."""
        try:
            os.killpg(self._process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty: everything in it has ended

    def _only_script(self, handler: Any) -> Any:
        def answer(message: Message) -> Reply:
            if message.source != self._script_cell:
                log.warning("client API request refused source=%s expected=%s", message.source, self._script_cell)
                return Reply(header={"error": f"only {self._script_cell} may use this executor"}, status=Status.OK)
            return handler(message)

        return answer

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
        # The script pulled the task before it could answer: the executor's copy of its params
        # goes back to the tensor pool now, and the result's tensors land in that memory.
        self.exchange.drop_task_params()
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
