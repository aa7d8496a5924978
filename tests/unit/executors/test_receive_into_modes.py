"""``flare.receive(into=...)`` with a target that does not fit, in both execution modes.

The script's error names the key, and its tensors are as they were; in ``subprocess`` mode the
task's tensors come over a local cell, so this is the streamed path (the chunks land in new
memory, then the check refuses them), in ``in_process`` mode the copy path.
"""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from engine.client.backends import install_backend
from engine.executors.client_api import ClientAPIExecutor
from engine.executors.executor import ExecutorContext
from engine.model import FLModel, ReturnCode, shareable_from_model

#: Receives into a 3 x 3 zero weight; the task's is 2 x 3. Writes the error and whether it stayed zero.
SCRIPT = """
    import json
    import torch
    from engine import client as flare
    from engine.client import IntoMismatchError
    from engine.model import FLModel

    flare.init()
    target = {"w": torch.zeros(3, 3), "b": torch.zeros(3)}
    try:
        flare.receive(timeout=20, into=target)
        error = "none"
    except IntoMismatchError as e:
        error = str(e)
    with open("outcome.json", "w") as out:
        json.dump({"error": error, "untouched": all(bool((t == 0).all()) for t in target.values())}, out)
    flare.send(FLModel(metrics={"done": 1}))
"""


@pytest.mark.parametrize("execution_mode", ["in_process", "subprocess"])
def test_a_target_that_does_not_fit_is_named_and_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, execution_mode: str
) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT), encoding="utf-8")
    executor = ClientAPIExecutor(task_script_path="train.py", execution_mode=execution_mode, task_timeout_s=30.0)
    executor.initialize(ExecutorContext("site-1", "job-1", workspace=tmp_path, custom_dir=tmp_path))
    weights = {"w": torch.ones(2, 3) * 5, "b": torch.ones(3) * 5}  # w: 24 bytes, more than one small chunk
    try:
        result = executor.execute("train", shareable_from_model(FLModel(params=weights)), threading.Event())
    finally:
        executor.finalize()
        install_backend(None)

    assert result.get_return_code() is ReturnCode.OK
    outcome = (tmp_path / "outcome.json").read_text()
    assert "'w' arrived with shape (2, 3), the target has (3, 3)" in outcome
    assert '"untouched": true' in outcome
