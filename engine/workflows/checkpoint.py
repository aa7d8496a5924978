"""`RoundCheckpoint`: what a round-based workflow needs to resume after the server stopped.

After each round's model is saved, the workflow records, in the folder the runtime gives it
(``JobContext.checkpoint_dir``: ``checkpoint/<workflow id>/`` in the server's workspace):

- ``model-<round>.safetensors``: a second name (a hard link, no copy) of the global model file
  the persistor wrote, so that its next save, which renames a new file over the global model,
  leaves the checkpoint's model as it was;
- ``algorithm-<round>.safetensors``: the algorithm's tensors (FedOpt's moments, SCAFFOLD's
  control variate), when it has any;
- ``state.json``: the round to play next, the sampling generator's state, the persistor's state
  (the best key metric so far), the algorithm's other state, each file's size and SHA-256, and
  the SHA-256 of the record itself.

``state.json`` is written last (a temp file, fsync, rename, fsync of the folder), so a crash at any
point leaves the previous round's record and files whole; older files are deleted after it.
Reading checks every digest: a torn, truncated or edited checkpoint is refused with the file's
name, never half used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from engine.errors import CheckpointError
from engine.fault_points import fault_point
from engine.persistors.checkpoint_files import fsync_file, fsync_folder, write_safetensors_atomic

log = logging.getLogger(__name__)

#: The record of a workflow's last completed round.
STATE_FILE = "state.json"
#: The record's format; a record of another format is refused.
FORMAT = 1
_HASH_BLOCK = 8 << 20
_ROUND_FILE = re.compile(r"^(model|algorithm)-(\d+)\.safetensors$")


@dataclasses.dataclass
class ResumeState:
    """A workflow's state after a completed round: enough to play the next round as if it never stopped.

    Attributes:
        next_round: The round to play next (0-based); the workflow's end when every round was played.
        rng_state: The sampling generator's state (``random.Random.getstate()``) before that round.
        persistor: The persistor's own state (e.g. the best key metric so far).
        algorithm: The algorithm's state that is not tensors.
        whole_from: Sites whose results are taken whole (their result was once refused midway).
        model_file: The checkpoint's copy of the global model the next round starts from.
        algorithm_tensors: The algorithm's tensors, read back (empty when it has none).
    """

    next_round: int
    rng_state: Any
    persistor: dict[str, Any] = dataclasses.field(default_factory=dict)
    algorithm: dict[str, Any] = dataclasses.field(default_factory=dict)
    whole_from: list[str] = dataclasses.field(default_factory=list)
    model_file: Path | None = None
    algorithm_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class RoundCheckpoint:
    """The checkpoint folder of one workflow of a job.

    Args:
        folder: ``<server workspace>/checkpoint/<workflow id>`` (made when first written).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @property
    def state_file(self) -> Path:
        """The record of the last completed round."""
        return self.folder / STATE_FILE

    def exists(self) -> bool:
        """Whether a round was ever recorded here."""
        return self.state_file.is_file()

    def write(self, state: ResumeState, model_file: Path, tensors: dict[str, torch.Tensor]) -> None:
        """Record ``state``, with ``model_file`` (the saved global model) and the algorithm's ``tensors``.

        Raises:
            OSError: A file could not be written (a full disk); the previous record is intact.
        """
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for leftover in self.folder.glob("*.tmp"):  # a write cut short by a crash
            leftover.unlink(missing_ok=True)
        try:
            self._write(state, model_file, tensors)
        except BaseException:
            for leftover in self.folder.glob("*.tmp"):  # a full disk leaves no half file behind
                leftover.unlink(missing_ok=True)
            raise

    def _write(self, state: ResumeState, model_file: Path, tensors: dict[str, torch.Tensor]) -> None:
        round_ = state.next_round
        model_copy = self.folder / f"model-{round_}.safetensors"
        _replace_with_link(model_file, model_copy)
        record: dict[str, Any] = {
            "format": FORMAT,
            "next_round": round_,
            "rng_state": _json_rng(state.rng_state),
            "persistor": state.persistor,
            "algorithm": state.algorithm,
            "whole_from": sorted(state.whole_from),
            "model": _file_entry(model_copy),
        }
        if tensors:
            tensors_file = self.folder / f"algorithm-{round_}.safetensors"
            write_safetensors_atomic(tensors, tensors_file)  # a tensor at a time, never a second copy of all
            record["algorithm_tensors"] = _file_entry(tensors_file)
        record["digest"] = _digest_of(record)
        temp = self.state_file.with_name(STATE_FILE + ".tmp")
        temp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        fsync_file(temp)
        fault_point("checkpoint_write")  # the fault suite's hook: a crash before the record is renamed
        os.replace(temp, self.state_file)
        fsync_folder(self.folder)
        self._drop_older_than(round_)
        log.info("checkpoint written: folder=%s next_round=%d", self.folder, round_ + 1)

    def read(self) -> ResumeState | None:
        """The last recorded state, its files checked; None when nothing was recorded.

        Raises:
            CheckpointError: The record or one of its files is unreadable, torn, truncated or
                changed; the message names the file.
        """
        if not self.exists():
            return None
        path = self.state_file
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable checkpoint record: {e}") from e
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a checkpoint record of format {FORMAT}")
        claimed = record.pop("digest", None)
        if claimed != _digest_of(record):
            raise CheckpointError(f"{path}: the record's digest does not match its content (torn or edited)")
        try:
            next_round = record["next_round"]
            if type(next_round) is not int or next_round < 0:
                raise TypeError("next_round must be an integer >= 0")
            model_file = self._checked_file(record["model"])
            tensors: dict[str, torch.Tensor] = {}
            if "algorithm_tensors" in record:
                tensors_file = self._checked_file(record["algorithm_tensors"])
                tensors = safetensors.torch.load_file(str(tensors_file))
            return ResumeState(
                next_round=next_round,
                rng_state=_rng_from_json(record["rng_state"]),
                persistor=dict(record.get("persistor") or {}),
                algorithm=dict(record.get("algorithm") or {}),
                whole_from=[str(site) for site in record.get("whole_from") or []],
                model_file=model_file,
                algorithm_tensors=tensors,
            )
        except CheckpointError:
            raise
        except Exception as e:  # a record that passed its digest but does not hold what it must
            raise CheckpointError(f"{path}: bad checkpoint record: {type(e).__name__}: {e}") from e

    def _checked_file(self, entry: Any) -> Path:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise CheckpointError(f"{self.state_file}: a file entry is malformed")
        name = entry["name"]
        if _ROUND_FILE.match(name) is None:
            raise CheckpointError(f"{self.state_file}: {name!r} is not a checkpoint file name")
        path = self.folder / name
        try:
            size = path.stat().st_size
        except OSError as e:
            raise CheckpointError(f"{path}: the checkpoint's file is missing: {e}") from e
        if size != entry.get("bytes"):
            raise CheckpointError(f"{path}: {size} bytes, the checkpoint recorded {entry.get('bytes')} (truncated?)")
        if _sha256(path) != entry.get("sha256"):
            raise CheckpointError(f"{path}: its SHA-256 does not match the checkpoint's record (torn or changed)")
        return path

    def _drop_older_than(self, round_: int) -> None:
        for path in self.folder.iterdir():
            found = _ROUND_FILE.match(path.name)
            if found is not None and int(found.group(2)) < round_:
                path.unlink(missing_ok=True)


def _file_entry(path: Path) -> dict[str, Any]:
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _digest_of(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()


def _replace_with_link(source: Path, link: Path) -> None:
    """Give ``source`` the second name ``link`` (a copy where the file system has no hard links)."""
    temp = link.with_name(link.name + ".tmp")
    temp.unlink(missing_ok=True)
    try:
        os.link(source, temp)
    except OSError:
        shutil.copyfile(source, temp)
        fsync_file(temp)
    os.replace(temp, link)


def _json_rng(state: Any) -> Any:
    """``random.Random.getstate()`` as JSON (tuples become lists)."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_from_json(value: Any) -> Any:
    version, internal, gauss = value
    if not isinstance(internal, list) or not all(type(x) is int for x in internal):
        raise TypeError("rng_state is not a generator state")
    return (version, tuple(internal), gauss)


def resume_round_loop(workflow: Any, checkpoint: RoundCheckpoint, rng: Any) -> int | None:
    """Give a round-based workflow (`engine.workflows.round_loop.RoundLoop`) its state of the last recorded round.

    Restores the sampling generator ``rng``, the persistor's global model and state, the
    algorithm's state and the sites whose results are taken whole.

    Returns:
        The round to play next; None when nothing was recorded (the workflow starts at its start).

    Raises:
        CheckpointError: The checkpoint is torn, truncated or does not fit this workflow (the
            message names the file).
    """
    state = checkpoint.read()
    if state is None:
        return None
    end = workflow.start_round + workflow.num_rounds
    if not workflow.start_round <= state.next_round <= end:
        raise CheckpointError(
            f"{checkpoint.state_file}: round {state.next_round + 1} is not a round of this workflow "
            f"({workflow.start_round + 1}..{end}): the checkpoint is another run's"
        )
    assert state.model_file is not None
    rng.setstate(state.rng_state)
    workflow.persistor.resume_from(state.model_file, state.persistor)
    workflow.restore_algorithm_state(state.algorithm, state.algorithm_tensors)
    workflow._whole_from.update(state.whole_from)
    log.warning("workflow resumed: next_round=%d of %d checkpoint=%s", state.next_round + 1, end, checkpoint.folder)
    workflow.context.report("workflow_resumed", round=state.next_round, total_rounds=workflow.num_rounds)
    return state.next_round


def record_round(
    workflow: Any, checkpoint: RoundCheckpoint, next_round: int, rng_state: Any, whole_from: set[str]
) -> None:
    """Record what resuming a round-based workflow at ``next_round`` needs (its model is saved).

    A failure (a full disk, a persistor without a model file) is logged and reported as
    ``checkpoint_failed``, never raised: the job goes on, resumable from the last record written.
    """
    try:
        model_file = workflow.persistor.saved_model_file()
        if model_file is None:
            raise CheckpointError(f"{type(workflow.persistor).__name__} keeps no global model file to resume from")
        values, tensors = workflow.algorithm_state()
        state = ResumeState(next_round, rng_state, workflow.persistor.resume_state(), values, sorted(whole_from))
        checkpoint.write(state, model_file, tensors)
    except (OSError, CheckpointError) as e:
        log.warning("checkpoint not written: round=%d folder=%s reason=%s", next_round + 1, checkpoint.folder, e)
        workflow.context.report("checkpoint_failed", round=next_round, reason=f"{type(e).__name__}: {e}")
