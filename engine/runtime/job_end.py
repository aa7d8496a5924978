"""What the server asks of its components when a job ends: finish their writes, say what looks wrong."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from engine.runtime.states import JobState

log = logging.getLogger(__name__)


@dataclass
class JobOutcome:
    """How the server job ended.

    Attributes:
        state: The final state.
        reason: Why it ended that way (empty when it completed).
        rounds: Each finished round's record.
        warnings: What components said was likely a mistake once the run was over
            (`end_of_run_warnings`).
    """

    state: JobState
    reason: str = ""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def end_of_run_warnings(components: dict[str, Any]) -> list[str]:
    """Ask every component with an ``end_of_run_warnings()`` hook what looks like a mistake, now the run is over.

    The hook is optional and returns lines such as ``key_metric 'acuracy' was never reported;
    ...``; each is prefixed with the component's id. A hook that raises is logged and skipped:
    a warning never fails a job.

    Example::

        class MyPersistor(ModelPersistor):
            def end_of_run_warnings(self) -> list[str]:
                return [] if self.saved_best else ["no model was ever the best"]
    """
    warnings = []
    for component_id, component in components.items():
        hook = getattr(component, "end_of_run_warnings", None)
        if not callable(hook):
            continue
        try:
            lines = hook()
        except Exception:
            log.exception("end_of_run_warnings failed component=%s", component_id)
            continue
        warnings.extend(f"{component_id}: {line}" for line in lines or [] if isinstance(line, str))
    return warnings


def flush_components(components: dict[str, Any], outcome: JobOutcome) -> JobOutcome:
    """Let every component with a ``flush`` finish its writes (checkpoints saved in the background).

    A failure makes a completed job one that ended in an exception, with the component named.
    """
    for component_id, component in components.items():
        flush = getattr(component, "flush", None)
        if not callable(flush):
            continue
        try:
            flush()
        except Exception as e:
            log.exception("flush failed component=%s", component_id)
            if outcome.state is JobState.FINISHED_COMPLETED:
                reason = f"component {component_id!r} could not finish its writes: {type(e).__name__}: {e}"
                outcome = JobOutcome(JobState.FINISHED_EXECUTION_EXCEPTION, reason, outcome.rounds)
    return outcome
