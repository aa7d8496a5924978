"""At the end of a job the server lets components finish their writes; a failure there fails the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model import FLModel
from engine.persistors import PTFileModelPersistor
from engine.runtime.job_end import JobOutcome, flush_components
from engine.runtime.states import JobState


def saved_persistor(tmp_path: Path) -> PTFileModelPersistor:
    persistor = PTFileModelPersistor(model=torch.nn.Linear(2, 2))
    persistor.use_workspace(tmp_path)
    persistor.save_model(FLModel(params=persistor.load_model().params))
    return persistor


def test_a_completed_job_ends_with_its_checkpoint_in_place(tmp_path: Path) -> None:
    persistor = saved_persistor(tmp_path)

    outcome = flush_components({"persistor": persistor, "other": object()}, JobOutcome(JobState.FINISHED_COMPLETED))

    assert outcome.state is JobState.FINISHED_COMPLETED
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["global.safetensors"]


def test_a_checkpoint_that_could_not_be_saved_fails_the_job_and_names_the_component(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(src: str, dst: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("os.replace", refuse)
    persistor = saved_persistor(tmp_path)

    outcome = flush_components({"persistor": persistor}, JobOutcome(JobState.FINISHED_COMPLETED, rounds=[{"round": 0}]))

    assert outcome.state is JobState.FINISHED_EXECUTION_EXCEPTION
    assert "component 'persistor' could not finish its writes" in outcome.reason
    assert "global.safetensors was not saved: Input/output error" in outcome.reason
    assert outcome.rounds == [{"round": 0}]
    assert list((tmp_path / "models").iterdir()) == []  # no temp file left


def test_an_aborted_job_keeps_its_own_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.replace", lambda src, dst: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    persistor = saved_persistor(tmp_path)

    outcome = flush_components({"persistor": persistor}, JobOutcome(JobState.FINISHED_ABORTED, "stopped by user"))

    assert (outcome.state, outcome.reason) == (JobState.FINISHED_ABORTED, "stopped by user")
