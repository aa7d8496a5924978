"""`flengine validate` refuses a ``key_metric`` no range bounds (one site could pick the best model)."""

from __future__ import annotations

import pytest

from engine.config import validate_job

from .sample_job import MakeJob

S = "job/app/config/config_fed_server.conf"

SERVER = """\
format_version = 2
workflows = [
  {{ id = fedavg, path = engine.workflows.FedAvg, args {{ num_rounds = 2{ranges} }} }}
]
components = [
  {{ id = persistor, path = engine.persistors.PTFileModelPersistor, args {{
    model {{ path = engine.examples.digits.Net, args {{ hidden = 8 }} }}, key_metric = {key} }} }}
]
"""


@pytest.mark.parametrize(
    ("key", "ranges", "expected"),
    [
        ("global_accuracy", "", []),
        ("val_loss", ", metric_ranges { val_loss = [0, 10] }", []),
        (
            "val_loss",
            "",
            [
                f"{S}:7: components[0].args.key_metric: key_metric 'val_loss' has no range: one site reporting a "
                "huge value would pick the best model (declare it in the workflow's args, e.g. "
                "`metric_ranges { val_loss = [low, high] }`)"
            ],
        ),
        ("val_loss", ", metric_ranges { other = [0, 1] }", ["key_metric 'val_loss' has no range"]),
    ],
    ids=["default-range", "declared-range", "no-range", "range-of-another-metric"],
)
def test_key_metric_needs_a_range(make_job: MakeJob, key: str, ranges: str, expected: list[str]) -> None:
    job = make_job({"app/config/config_fed_server.conf": SERVER.format(key=key, ranges=ranges)})

    problems = [str(p) for p in validate_job(job) if "key_metric" in str(p)]

    assert len(problems) == len(expected)
    for problem, text in zip(problems, expected, strict=True):
        assert text in problem
