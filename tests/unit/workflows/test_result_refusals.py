"""A site's refused result (`ResultRefused`) against a bug in a check (any other exception), on a real task queue.

A refusal is the site's: in the round's ``refused``, logged without a traceback. A bug in a custom
``check_result`` is the server's: the result fails (``failed`` only) with a reason that says so,
its traceback is logged, and the round goes on with the other results; a bug that fails every
result ends the job with a `WorkflowError` that names it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.errors import ResultRefused, WorkflowError
from engine.model import FLModel
from engine.persistors import PTFileModelPersistor
from engine.workflows import FedAvg
from tests.unit.workflows.test_fedavg import CLIENTS, Net, _capture, next_task, reply

BUG = "the check's own bug"


class CheckedFedAvg(FedAvg):
    """FedAvg with a custom check that raises ``raises[site]`` for that site's result."""

    def __init__(self, raises: dict[str, BaseException], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raises = raises

    def check_result(self, result: FLModel, client: str, current_round: int, reference: dict[str, Any]) -> None:
        super().check_result(result, client, current_round, reference)
        if client in self.raises:
            raise self.raises[client]


def play_round(tmp_path: Path, raises: dict[str, BaseException], min_clients: int = 1):
    """One round of ``CheckedFedAvg``, both sites sending honest results; return (workflow, events, errors, final)."""
    queue = TaskQueue(CLIENTS)
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(tmp_path)
    workflow = CheckedFedAvg(raises, num_clients=2, num_rounds=1, min_clients=min_clients)
    events: list[tuple[str, dict]] = []
    context = JobContext(
        workspace=tmp_path,
        components={"persistor": persistor},
        report=lambda event, **fields: events.append((event, fields)),
    )
    workflow.bind(queue, context=context)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(workflow.run, errors), daemon=True)
    thread.start()
    try:
        for site, value in (("site-1", 1.0), ("site-2", 3.0)):
            task = next_task(queue, site)
            queue.submit(
                site, task.task_id, reply({"fc.weight": torch.full((3, 4), value), "fc.bias": torch.zeros(3)}, 1)
            )
        thread.join(10)
    finally:
        queue.end_run()
    assert not thread.is_alive()
    return workflow, events, errors, persistor.load_model().params


def test_a_result_refused_by_a_custom_check_is_the_sites_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        workflow, events, errors, final = play_round(tmp_path, {"site-1": ResultRefused("result of site-1: no epoch")})

    assert errors == []
    assert workflow.refused == {"site-1": "result of site-1: no epoch"}
    assert workflow.failures == {"site-1": "result of site-1: no epoch"}
    assert torch.equal(final["fc.weight"], torch.full((3, 4), 3.0))  # site-2's alone
    done = [fields for event, fields in events if event == "round_done"]
    assert done[0]["refused"] == {"site-1": "result of site-1: no epoch"} and done[0]["clients"] == ["site-2"]
    assert not [r for r in caplog.records if r.exc_info]  # a refusal is logged without a traceback


@pytest.mark.parametrize(
    "bug",
    [ValueError(BUG), KeyError(BUG), ZeroDivisionError(BUG)],
    ids=["value-error", "key-error", "zero-division"],
)
def test_a_bug_in_a_custom_check_fails_the_result_and_is_never_counted_as_a_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bug: Exception
) -> None:
    with caplog.at_level(logging.WARNING):
        workflow, events, errors, final = play_round(tmp_path, {"site-1": bug})

    assert errors == []  # the round goes on with site-2
    assert workflow.refused == {}
    reason = workflow.failures["site-1"]
    assert reason.startswith(f"checking the result raised {type(bug).__name__}: ")
    assert "a bug in the server's checks, not a refusal by the site" in reason
    assert torch.equal(final["fc.weight"], torch.full((3, 4), 3.0))
    done = [fields for event, fields in events if event == "round_done"]
    assert done[0]["failed"]["site-1"] == reason and done[0]["refused"] == {}
    tracebacks = [r for r in caplog.records if r.exc_info and r.exc_info[1] is bug]
    assert len(tracebacks) == 1 and tracebacks[0].levelno == logging.ERROR


def test_a_bug_that_fails_every_result_ends_the_job_naming_it(tmp_path: Path) -> None:
    workflow, events, errors, final = play_round(tmp_path, {site: ValueError(BUG) for site in CLIENTS}, min_clients=2)

    assert len(errors) == 1 and isinstance(errors[0], WorkflowError)
    message = str(errors[0])
    assert message.startswith("round 1: 0 usable result(s), 2 needed (min_clients)")
    assert f"site-1: checking the result raised ValueError: {BUG} (a bug in the server's checks" in message
    assert workflow.refused == {}
