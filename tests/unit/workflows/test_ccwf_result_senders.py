"""The server side of cross-site evaluation takes a validation result only from the evaluator it
asked, for the model it asked about: another client's answer to the same task is late."""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.controller import SubmitOutcome
from engine.workflows.ccwf import CrossSiteEvalServerController
from engine.workflows.ccwf.cross_site_eval import RESULT_FILE
from tests.unit.workflows.test_ccwf_server import CLIENTS, answer, finish, metrics_reply, start  # noqa: F401


def test_only_the_asked_evaluator_fills_its_cell_of_the_matrix(start, tmp_path: Path) -> None:  # noqa: F811
    queue, _, thread = start(
        CrossSiteEvalServerController(evaluators=["site-1"], evaluatees=["site-2"], global_model_client="@none")
    )
    for site in CLIENTS:
        answer(queue, site, "cse_config")
    deadline = time.monotonic() + 10
    while (assignment := queue.next_task("site-1")) is None:
        assert time.monotonic() < deadline, "site-1 got no cse_eval task"
        time.sleep(0.01)

    taken_from_others = {
        site: queue.submit(site, assignment.task_id, metrics_reply(0.9)) for site in ("site-2", "site-3")
    }
    taken_from_evaluator = queue.submit("site-1", assignment.task_id, metrics_reply(0.5))

    assert finish(thread) == []
    assert taken_from_others == {"site-2": SubmitOutcome.LATE, "site-3": SubmitOutcome.LATE}
    assert taken_from_evaluator is SubmitOutcome.ACCEPTED
    assert assignment.data["model_owner"] == "site-2" and assignment.data["model_name"] == "local"
    matrix = json.loads((tmp_path / RESULT_FILE).read_text())
    assert matrix == {"site-1": {"site-2": {"accuracy": 0.5}}}
