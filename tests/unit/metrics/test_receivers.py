"""The receivers: JSON lines and TensorBoard event files, read back and compared with what went in."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine.config import validate_job
from engine.errors import PathOutsideError
from engine.metrics import JsonLinesReceiver, Metric, MetricsIntake, TensorBoardReceiver


def read_scalars(run: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar of a TensorBoard run folder: tag -> [(step, value, wall time)]."""
    events = EventAccumulator(str(run))
    events.Reload()
    return {
        tag: [(event.step, event.value, event.wall_time) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def test_json_lines_hold_one_line_per_metric(tmp_path: Path) -> None:
    receiver = JsonLinesReceiver()
    receiver.use_workspace(tmp_path)
    metrics = [Metric("site-1", "loss", 0.5, 1, 1, 1000.0), Metric("server", "acc", 0.75, None, 3, 1001.25)]

    for metric in metrics:
        receiver.receive(metric)
    receiver.close()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"site": "site-1", "key": "loss", "value": 0.5, "round": 1, "step": 1, "time": 1000.0},
        {"site": "server", "key": "acc", "value": 0.75, "round": None, "step": 3, "time": 1001.25},
    ]


@pytest.mark.parametrize("name", ["../metrics.jsonl", "/tmp/x.jsonl", "logs/m.jsonl", "..", ""], ids=str)
def test_json_lines_take_a_plain_file_name(name: str) -> None:
    with pytest.raises((PathOutsideError, ValueError), match="^file_name: expected a plain file name"):
        JsonLinesReceiver(file_name=name)


def test_json_lines_refuse_a_link_that_leads_out_of_the_workspace(tmp_path: Path) -> None:
    outside = tmp_path / "outside.jsonl"
    workspace = tmp_path / "server"
    workspace.mkdir()
    (workspace / "metrics.jsonl").symlink_to(outside)
    receiver = JsonLinesReceiver()
    receiver.use_workspace(workspace)

    with pytest.raises(PathOutsideError, match="through a symbolic link"):
        receiver.receive(Metric("site-1", "loss", 0.5, 1, 1, 1000.0))
    assert not outside.exists()


def test_tensorboard_has_a_run_per_site_with_each_value_at_its_step(tmp_path: Path) -> None:
    receiver = TensorBoardReceiver()
    receiver.use_workspace(tmp_path)
    intake = MetricsIntake([receiver], ["site-1", "site-2"], "server", wall_clock=lambda: 1700000000.0)
    sent: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for current_round in range(3):
        for site in ("site-1", "site-2"):
            value = 0.5 + current_round / 10 + (site == "site-2") / 100
            intake.from_site(site, "local_accuracy", value, current_round)
            sent.setdefault((site, "local_accuracy"), []).append((current_round + 1, value))
        intake.from_server({"global_accuracy": 0.6 + current_round / 10}, current_round)
        sent.setdefault(("server", "global_accuracy"), []).append((current_round + 1, 0.6 + current_round / 10))
    for i in range(3):  # logged several times in round 1 (0-based 0): steps count on from the round
        intake.from_site("site-1", "train/loss", 2.0 - i, 0)
    intake.close()

    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["server", "site-1", "site-2"]
    for (site, key), expected in sent.items():
        scalars = read_scalars(tmp_path / "tb" / site)
        assert [step for step, _, _ in scalars[key]] == [step for step, _ in expected]
        assert [value for _, value, _ in scalars[key]] == pytest.approx([value for _, value in expected], abs=1e-6)
        assert {wall for _, _, wall in scalars[key]} == {1700000000.0}
    loss = read_scalars(tmp_path / "tb" / "site-1")["train/loss"]
    assert [(step, value) for step, value, _ in loss] == [(1, 2.0), (2, 1.0), (3, 0.0)]


@pytest.mark.parametrize("site", ["../escape", "a/b", "..", "", ".hidden", "x" * 65], ids=str)
def test_tensorboard_makes_a_run_only_for_a_plain_site_name(tmp_path: Path, site: str) -> None:
    receiver = TensorBoardReceiver()
    receiver.use_workspace(tmp_path / "server")

    with pytest.raises(ValueError, match="is not a plain site name"):
        receiver.receive(Metric(site, "loss", 0.5, 1, 1, 1000.0))
    receiver.close()
    assert sorted(p.name for p in tmp_path.rglob("*")) in ([], ["server"], ["server", "tb"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"folder_name": "../tb"}, "^folder_name: expected a plain file name"),
        ({"flush_interval_s": 0}, "^flush_interval_s: expected seconds > 0"),
        ({"flush_interval_s": float("nan")}, "^flush_interval_s: expected seconds > 0"),
    ],
    ids=["folder-out", "flush-zero", "flush-nan"],
)
def test_tensorboard_args_are_checked(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorBoardReceiver(**args)


def test_without_tensorboard_the_receiver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` sees when it is missing

    with pytest.raises(ImportError, match=r"pip install flengine\[tensorboard\]"):
        TensorBoardReceiver()


SERVER_WITH_TB = """\
format_version = 2
workflows = [
  { id = wf, path = model.Workflow, args { num_rounds = 2 } }
]
components = [
  { id = persistor, path = model.Persistor, args { model { path = model.Net, args { hidden = 8 } } } }
  { id = tb, path = engine.metrics.TensorBoardReceiver, args { } }
]
"""


def test_validate_reports_a_missing_tensorboard_at_the_components_line(
    make_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = make_job({"app/config/config_fed_server.conf": SERVER_WITH_TB})
    assert validate_job(job) == []
    monkeypatch.setitem(sys.modules, "tensorboard", None)

    problems = [str(problem) for problem in validate_job(job)]

    assert problems == [
        "job/app/config/config_fed_server.conf:7: components[1].path: engine.metrics.TensorBoardReceiver needs "
        "the 'tensorboard' package, which is not installed (pip install flengine[tensorboard])"
    ]
