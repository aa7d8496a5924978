"""The lifecycle states of a job, as recorded in ``summary.json``."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """Where a job is in its life; the three FINISHED states are final."""

    SUBMITTED = "SUBMITTED"
    RUNNING = "RUNNING"
    FINISHED_COMPLETED = "FINISHED_COMPLETED"
    FINISHED_ABORTED = "FINISHED_ABORTED"
    FINISHED_EXECUTION_EXCEPTION = "FINISHED_EXECUTION_EXCEPTION"

    @property
    def is_final(self) -> bool:
        return self.name.startswith("FINISHED")
