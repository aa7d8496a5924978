"""The job's sites the client runtime gives an executor reach its training script, in a thread or a process."""

from __future__ import annotations

import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.client.backends import install_backend
from engine.executors import ClientAPIExecutor
from engine.executors.executor import ExecutorContext
from engine.model import FLModel, ReturnCode
from engine.model.convert import model_from_shareable, shareable_from_model

SCRIPT = """
from engine import client as flare
from engine.model import FLModel

flare.init()
while flare.is_running():
    if flare.receive() is None:
        break
    try:
        answer = {"index": flare.get_site_index(), "num_sites": flare.get_num_sites(), "sites": flare.get_job_sites()}
    except flare.ClientAPIError as e:
        answer = {"error": str(e)}
    flare.send(FLModel(metrics=answer))
"""


@pytest.fixture
def ask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``ask(mode, site, job_sites)``: what the script says of the sites, run by a real executor."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the in-process runner sets the script's argv
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sites.py").write_text(textwrap.dedent(SCRIPT), encoding="utf-8")
    started: list[ClientAPIExecutor] = []

    def run(mode: str, site: str, job_sites: tuple[str, ...]) -> dict:
        context = ExecutorContext(site, "job-1", tmp_path, custom_dir=tmp_path, job_sites=job_sites)
        executor = ClientAPIExecutor(task_script_path="sites.py", execution_mode=mode, task_timeout_s=60.0)
        executor.initialize(context)
        started.append(executor)
        result = executor.execute("train", shareable_from_model(FLModel(params={})), threading.Event())
        assert result.get_return_code() is ReturnCode.OK, result
        return model_from_shareable(result).metrics

    yield run
    for executor in started:
        executor.finalize()
    install_backend(None)


@pytest.mark.parametrize("mode", ["in_process", "subprocess"])
def test_the_script_gets_its_place_among_the_job_sites(ask, mode: str) -> None:
    answer = ask(mode, "lab-c", ("hospital-b", "lab-c", "lab-a"))

    assert answer == {"index": 1, "num_sites": 3, "sites": ["hospital-b", "lab-c", "lab-a"]}


@pytest.mark.parametrize("mode", ["in_process", "subprocess"])
def test_a_runtime_that_gave_no_sites_gets_the_fix_in_the_error(ask, mode: str) -> None:
    answer = ask(mode, "lab-c", ())

    assert answer["error"].startswith("the job's sites are unknown to lab-c: its client job was started without them")
