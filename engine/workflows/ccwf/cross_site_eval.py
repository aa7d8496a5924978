"""`CrossSiteEvalServerController`: every evaluator validates every evaluatee's model and the global one.

Models go from their owner straight to each evaluator (peer to peer, pulled with the downloader);
the server only sends the ``cse_eval`` tasks (names, no tensors) and collects the metrics into a
matrix, written to ``<server workspace>/cross_site_val.json`` and reported for the end-of-run table.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from engine.aggregators import ResultRules
from engine.controller import Task, TaskCompletionStatus
from engine.errors import WorkflowError
from engine.model import ReturnCode, Shareable, model_from_shareable
from engine.model.ccwf import EVAL_TASK, GLOBAL_MODELS_KEY, LOCAL_MODEL, MODEL_NAME_KEY, MODEL_OWNER_KEY
from engine.paths import JobPaths, path_inside, relative_path
from engine.workflows.ccwf.server_side import REASON_HEADER, ServerSideController, clients_among

log = logging.getLogger(__name__)

#: Task name prefix of cross-site evaluation; clients route ``cse_*`` to their controller.
CSE_PREFIX = "cse"
#: The matrix's file, in the server's folder of the workspace.
RESULT_FILE = "cross_site_val.json"
#: Say so in ``evaluatees`` or ``global_model_client`` to leave those models out.
NONE = "@none"
#: How messages call the folder ``result_file`` must stay in.
RESULT_FOLDER = "the server's workspace folder"


class CrossSiteEvalServerController(ServerSideController):
    """Cross-site evaluation, driven by the server, with models moving between the clients.

    Args:
        eval_task_timeout: Seconds an evaluator has to get one model and validate it.
        participating_clients: The clients that take part; None = all.
        evaluators: The clients that validate; None = all participants.
        evaluatees: The clients whose own models are validated; None = all participants,
            ``"@none"`` = none.
        global_model_client: The client whose persistor holds the global model(s); empty = the
            first participant, ``"@none"`` = no global model.
        configure_task_timeout: Seconds every client has to take the config task (an evaluatee
            gets its local model ready then).
        start_task_timeout: Unused (the server drives the evaluation); kept for configs
            written for NVIDIA FLARE.
        progress_timeout: Unused, as above.
        max_status_report_interval: Unused, as above.
        result_file: Where the matrix goes, relative to the server's workspace folder, which it
            must not leave: an absolute path or one that climbs out with ``..`` is refused when
            the config is built, a symbolic link that leads out at job start (`use_job_paths`)
            and again before the file is written.
        task_name_prefix: Prefix of the task names (``cse``).
        metric_ranges: Metric name -> ``[low, high]``: an evaluator's value outside (or not a
            finite number, or under a name that is not a plain identifier) is left out of the
            matrix and logged.

    Raises:
        PathOutsideError: ``result_file`` is absolute or climbs out of the workspace with ``..``.
    """

    def __init__(
        self,
        eval_task_timeout: float = 300.0,
        participating_clients: list[str] | None = None,
        evaluators: list[str] | None = None,
        evaluatees: list[str] | str | None = None,
        global_model_client: str = "",
        configure_task_timeout: float = 300.0,
        start_task_timeout: float = 10.0,
        progress_timeout: float = 3600.0,
        max_status_report_interval: float = 90.0,
        result_file: str = RESULT_FILE,
        task_name_prefix: str = CSE_PREFIX,
        metric_ranges: dict[str, list[float]] | None = None,
    ) -> None:
        super().__init__(
            task_name_prefix,
            configure_task_timeout=configure_task_timeout,
            start_task_timeout=start_task_timeout,
            participating_clients=participating_clients,
            max_status_report_interval=max_status_report_interval,
            progress_timeout=progress_timeout,
        )
        if eval_task_timeout <= 0:
            raise ValueError(f"eval_task_timeout: expected seconds > 0, got {eval_task_timeout!r}")
        if evaluatees == NONE and global_model_client == NONE:
            raise ValueError("evaluatees and global_model_client cannot both be '@none': nothing to evaluate")
        self.eval_task_timeout = eval_task_timeout
        self.evaluators = list(evaluators) if evaluators else None
        self.evaluatees = evaluatees
        self.global_model_client = global_model_client
        if relative_path(result_file, "result_file", RESULT_FOLDER).name in ("", ".", ".."):
            raise ValueError(f"result_file: expected the path of a file, got {result_file!r}; e.g. {RESULT_FILE!r}")
        self.result_file = result_file
        self.rules = ResultRules.from_args(metric_ranges=metric_ranges)
        self.matrix: dict[str, dict[str, Any]] = {}
        self._global_models: list[str] = []

    def use_job_paths(self, paths: JobPaths) -> None:
        """Check at job start that ``result_file`` (symbolic links resolved) stays in the server's workspace.

        Raises:
            PathOutsideError: It leads out of ``paths.workspace``; the message names ``result_file``.
        """
        self._result_path(paths.workspace)

    def workflow_config(self, participants: list[str]) -> dict[str, Any]:
        config = super().workflow_config(participants)
        evaluators = clients_among("evaluators", self.evaluators, participants)
        if self.evaluatees == NONE:
            evaluatees: list[str] = []
        else:
            chosen = None if self.evaluatees is None else list(self.evaluatees)
            evaluatees = clients_among("evaluatees", chosen, participants)
        holder = "" if self.global_model_client == NONE else (self.global_model_client or participants[0])
        if holder and holder not in participants:
            raise WorkflowError(f"global_model_client {holder!r} is not a participating client ({participants})")
        config.update(evaluators=evaluators, evaluatees=evaluatees, global_model_client=holder)
        self._config = config
        return config

    def configured(self, replies: dict[str, Shareable]) -> None:
        holder = self._config["global_model_client"]
        if holder:
            self._global_models = [str(name) for name in replies[holder].get(GLOBAL_MODELS_KEY) or []]

    def starts(self) -> bool:
        return False

    def follow_clients(self, participants: list[str]) -> None:
        """Evaluate each model on every evaluator, then write and report the matrix."""
        config = self._config
        models = [(config["global_model_client"], name) for name in self._global_models]
        models += [(site, LOCAL_MODEL) for site in config["evaluatees"]]
        self.context.report(
            "workflow_note", message=f"cross-site evaluation: {len(models)} models x {len(config['evaluators'])} sites"
        )
        for owner, name in models:
            if self.abort_signal.is_set():
                return
            self._evaluate(owner, name, config["evaluators"])
        self._write()

    def _evaluate(self, owner: str, name: str, evaluators: list[str]) -> None:
        label = owner if name == LOCAL_MODEL else f"{name} ({owner})"
        data = Shareable({MODEL_OWNER_KEY: owner, MODEL_NAME_KEY: name})
        task = Task(self.task_name(EVAL_TASK), data, timeout=self.eval_task_timeout)
        self.broadcast_and_wait(task, evaluators, min_responses=len(evaluators), abort_signal=self.abort_signal)
        for site in evaluators:
            self.matrix.setdefault(site, {})[label] = _cell(task, site, self.rules)
        log.info("model evaluated model=%s results=%s", label, {s: self.matrix[s][label] for s in evaluators})

    def _result_path(self, workspace: Path) -> Path:
        """``result_file`` in ``workspace``, resolved; `PathOutsideError` if a link leads it out."""
        return path_inside(workspace, self.result_file, "result_file", RESULT_FOLDER)

    def _write(self) -> None:
        path = self._result_path(self.context.workspace)  # again: a link may have appeared since the start
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new temp file (never one that is there: it could be a link), renamed over the result.
        fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                os.fchmod(out.fileno(), 0o644)  # as an ordinary new file, not mkstemp's owner-only mode
                out.write(json.dumps(self.matrix, indent=2, sort_keys=True) + "\n")
            os.replace(temp_name, path)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        self.context.report("cross_site_val", matrix=self.matrix, file=str(path))


def _cell(task: Task, site: str, rules: ResultRules) -> dict[str, Any]:
    """One evaluator's entry for one model: its accepted metrics (see `ResultRules`), or ``{"error": why}``."""
    client_task = task.last_client_task_map.get(site)
    if client_task is None:
        return {"error": "never took the task"}
    result = client_task.result
    if client_task.status is not TaskCompletionStatus.OK or result is None:
        reason = (result.get_header(REASON_HEADER) if result is not None else None) or client_task.reason
        status = client_task.status.value if client_task.status else "no result"
        return {"error": f"{status}: {reason}" if reason else status}
    if result.get_return_code() is not ReturnCode.OK:
        return {"error": str(result.get_header(REASON_HEADER) or result.get_return_code().value)}
    try:
        metrics = model_from_shareable(result).metrics or {}
    except ValueError as e:
        return {"error": f"the result carries no metrics: {e}"}
    return rules.accepted_metrics(metrics, site, None)
