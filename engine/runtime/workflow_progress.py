"""`WorkflowProgress`: which of a job's workflows completed and which was running, kept on disk for a resume.

The server job records it in ``<server workspace>/checkpoint/workflows.json`` as its workflows
start and end. When a job runs again after its server stopped, the workflows that completed are
not run again and the one that was running resumes from its own checkpoint
(``checkpoint/<workflow id>/``, see `engine.workflows.checkpoint`); the rounds it played before
come back from the server's events file (`earlier_rounds`), so its summary holds them all.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError

log = logging.getLogger(__name__)

#: The folder of a job's checkpoints, in the server's workspace (a subfolder per workflow).
CHECKPOINT_FOLDER = "checkpoint"
#: The record of the job's workflows, in that folder.
PROGRESS_FILE = "workflows.json"


class WorkflowProgress:
    """The record of a job's workflows: the completed ones, in order, and the one running.

    Args:
        path: The record's file (its folder is made on the first write).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def read(self) -> tuple[list[str], str | None]:
        """The completed workflows' ids and the running one's (None); nothing recorded: ([], None).

        Raises:
            CheckpointError: The record is unreadable or malformed (the message names the file).
        """
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return [], None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: unreadable record of the job's workflows: {e}") from e
        completed, running = record.get("completed") if isinstance(record, dict) else None, None
        if isinstance(record, dict):
            running = record.get("running")
        if not isinstance(completed, list) or not all(isinstance(i, str) for i in completed):
            raise CheckpointError(f"{self.path}: 'completed' must be a list of workflow ids")
        if running is not None and not isinstance(running, str):
            raise CheckpointError(f"{self.path}: 'running' must be a workflow id or null")
        return completed, running

    def started(self, workflow_id: str) -> None:
        """``workflow_id`` runs now."""
        completed, _ = self._read_or_empty()
        self._write(completed, workflow_id)

    def completed(self, workflow_id: str) -> None:
        """``workflow_id`` completed."""
        completed, _ = self._read_or_empty()
        self._write([*completed, workflow_id], None)

    def _read_or_empty(self) -> tuple[list[str], str | None]:
        try:
            return self.read()
        except CheckpointError as e:  # written by this job only: start the record again
            log.warning("%s", e)
            return [], None

    def _write(self, completed: list[str], running: str | None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temp = self.path.with_name(self.path.name + ".tmp")
        temp.write_text(json.dumps({"completed": completed, "running": running}) + "\n", encoding="utf-8")
        with open(temp, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temp, self.path)


def earlier_rounds(events_file: Path) -> list[dict[str, Any]]:
    """The ``round_done`` records of the job's earlier run (its server's events file), the last of each round kept."""
    rounds: dict[int, dict[str, Any]] = {}
    try:
        with events_file.open("rb") as stream:
            for line in stream:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut short when the server stopped
                if isinstance(event, dict) and event.get("event") == "round_done" and type(event.get("round")) is int:
                    fields = {k: v for k, v in event.items() if k not in ("event", "at")}
                    rounds = {k: v for k, v in rounds.items() if k < event["round"]}
                    rounds[event["round"]] = fields
    except OSError:
        return []
    return [rounds[k] for k in sorted(rounds)]
