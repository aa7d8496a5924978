"""`RoundCheckpoint` with real files: a record and its files read back as written; anything torn,
truncated, edited or missing is refused with the file's name; older rounds' files go."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import safetensors.torch
import torch

from engine.errors import CheckpointError
from engine.runtime.workflow_progress import WorkflowProgress
from engine.workflows.checkpoint import ResumeState, RoundCheckpoint


def _model_file(folder: Path, value: float) -> Path:
    path = folder / "global.safetensors"
    tmp = folder / "global.tmp"
    safetensors.torch.save_file({"w": torch.full((4, 4), value)}, str(tmp))
    tmp.replace(path)  # as the persistor does: a new file renamed over the old name
    return path


def _written(tmp_path: Path, next_round: int = 3, tensors: dict | None = None) -> tuple[RoundCheckpoint, random.Random]:
    rng = random.Random(7)
    rng.random()
    checkpoint = RoundCheckpoint(tmp_path / "checkpoint" / "fedavg")
    state = ResumeState(next_round, rng.getstate(), {"best": 0.5}, {"k": 1}, ["site-2"])
    checkpoint.write(state, _model_file(tmp_path, float(next_round)), tensors or {})
    return checkpoint, rng


def test_a_record_reads_back_as_written(tmp_path: Path) -> None:
    checkpoint, rng = _written(tmp_path, tensors={"m/w": torch.arange(6.0)})

    state = checkpoint.read()

    assert state is not None and state.next_round == 3
    restored = random.Random()
    restored.setstate(state.rng_state)
    assert restored.random() == rng.random()  # the generator goes on where it was
    assert state.persistor == {"best": 0.5} and state.algorithm == {"k": 1} and state.whole_from == ["site-2"]
    assert torch.equal(safetensors.torch.load_file(str(state.model_file))["w"], torch.full((4, 4), 3.0))
    assert torch.equal(state.algorithm_tensors["m/w"], torch.arange(6.0))


def test_the_checkpoints_model_survives_the_next_save_and_older_files_go(tmp_path: Path) -> None:
    checkpoint, _ = _written(tmp_path, 3)
    _model_file(tmp_path, 99.0)  # the persistor's next save, before the next record
    state = checkpoint.read()
    assert state is not None
    assert torch.equal(safetensors.torch.load_file(str(state.model_file))["w"], torch.full((4, 4), 3.0))

    _written(tmp_path, 4)

    names = sorted(path.name for path in checkpoint.folder.iterdir())
    assert names == ["model-4.safetensors", "state.json"]


def test_nothing_recorded_reads_as_none(tmp_path: Path) -> None:
    assert RoundCheckpoint(tmp_path / "none").read() is None


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_record(path: Path) -> None:
    record = json.loads(path.read_text())
    record["next_round"] = 0
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("target", "damage", "message"),
    [
        ("state.json", _truncate, r"state.json: unreadable checkpoint record"),
        ("state.json", _edit_record, r"state.json: the record's digest does not match its content"),
        (
            "model-3.safetensors",
            _truncate,
            r"model-3.safetensors: \d+ bytes, the checkpoint recorded \d+ \(truncated\?\)",
        ),
        ("model-3.safetensors", _flip_a_byte, r"model-3.safetensors: its SHA-256 does not match"),
        ("model-3.safetensors", Path.unlink, r"model-3.safetensors: the checkpoint's file is missing"),
        ("algorithm-3.safetensors", _flip_a_byte, r"algorithm-3.safetensors: its SHA-256 does not match"),
    ],
    ids=["record-truncated", "record-edited", "model-truncated", "model-flipped", "model-missing", "tensors-flipped"],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path, target: str, damage, message: str) -> None:
    checkpoint, _ = _written(tmp_path, tensors={"c/w": torch.ones(3)})
    damage(checkpoint.folder / target)

    with pytest.raises(CheckpointError, match=message):
        checkpoint.read()


def test_a_failed_write_leaves_the_previous_record_whole(tmp_path: Path) -> None:
    checkpoint, _ = _written(tmp_path, 3)
    (checkpoint.folder / "state.json.tmp").mkdir()  # the next record's temp file cannot be written

    with pytest.raises(OSError):
        _written(tmp_path, 4)

    state = checkpoint.read()
    assert state is not None and state.next_round == 3


def test_the_record_of_a_jobs_workflows(tmp_path: Path) -> None:
    progress = WorkflowProgress(tmp_path / "checkpoint" / "workflows.json")
    assert progress.read() == ([], None)

    progress.started("fedavg")
    assert progress.read() == ([], "fedavg")
    progress.completed("fedavg")
    progress.started("cse")
    assert progress.read() == (["fedavg"], "cse")

    progress.path.write_text('{"completed": "fedavg"}')
    with pytest.raises(CheckpointError, match=r"workflows.json: 'completed' must be a list of workflow ids"):
        progress.read()


def test_a_full_disk_keeps_the_last_record_whole_and_leaves_no_half_file(tmp_path: Path, small_disk: Path) -> None:
    checkpoint = RoundCheckpoint(small_disk / "fedavg")  # a 1 MiB file system: no hard link from tmp_path
    rng = random.Random(1)
    small = tmp_path / "small.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(1000)}, str(small))
    checkpoint.write(ResumeState(3, rng.getstate()), small, {})
    big = tmp_path / "big.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(600_000)}, str(big))  # 2.4 MB

    with pytest.raises(OSError):
        checkpoint.write(ResumeState(4, rng.getstate()), big, {})

    assert sorted(p.name for p in checkpoint.folder.iterdir()) == ["model-3.safetensors", "state.json"]
    state = checkpoint.read()
    assert state is not None and state.next_round == 3


def test_a_checkpoint_that_cannot_be_written_is_reported_and_the_job_goes_on(tmp_path: Path, small_disk: Path) -> None:
    from engine.controller.context import JobContext
    from engine.persistors import PTFileModelPersistor
    from engine.workflows.checkpoint import record_round

    class Workflow:  # what record_round reads of a round loop
        def __init__(self) -> None:
            self.persistor = PTFileModelPersistor(model=torch.nn.Linear(800, 800))
            self.persistor.use_workspace(tmp_path)
            self.persistor.save_model(self.persistor.load_model())
            self.events: list[tuple[str, dict]] = []
            self.context = JobContext(report=lambda event, **fields: self.events.append((event, fields)))

        def algorithm_state(self) -> tuple[dict, dict]:
            return {}, {}

    workflow = Workflow()
    record_round(workflow, RoundCheckpoint(small_disk / "fedavg"), 2, random.Random(0).getstate(), set())

    ((event, fields),) = workflow.events
    assert event == "checkpoint_failed" and fields["round"] == 2
    assert "No space left on device" in fields["reason"]
    assert not any((small_disk / "fedavg").glob("*.tmp"))
