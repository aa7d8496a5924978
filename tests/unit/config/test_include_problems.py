"""A refused include does not hide the other problems of its file (validate reads the rest of it)."""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.config import validate_job

REPO = Path(__file__).resolve().parents[3]


def _job_with_server_config(tmp_path: Path, text: str) -> Path:
    job = tmp_path / "job"
    shutil.copytree(REPO / "jobs" / "fedavg", job, ignore=shutil.ignore_patterns("__pycache__"))
    (job / "app" / "config" / "config_fed_server.conf").write_text(text, encoding="utf-8")
    return job


SERVER = """format_version = 2
include "missing.conf"
tensor_download_chunk_size = "2MB"
workflows = [
  { id = fedavg, path = engine.workflows.FedAvg, args { num_clients = 2, num_rouns = 3, persistor_id = persistor } }
]
components = [
  { id = persistor, path = engine.persistors.PTFileModelPersistor, args { model { path = engine.examples.digits.Net, args { hidden = 64 } } } }
]
"""


def test_a_missing_include_and_the_files_other_problems_are_all_reported(tmp_path: Path) -> None:
    job = _job_with_server_config(tmp_path, SERVER)

    problems = validate_job(job)

    lines = [(p.line, ".".join(str(k) for k in p.key_path), p.message) for p in problems]
    assert [line for line, _, _ in lines] == [2, 3, 5]
    assert "missing.conf" in lines[0][2]
    assert lines[1][1] == "tensor_download_chunk_size" and "expected an integer" in lines[1][2]
    assert lines[2][1].endswith("num_rouns") and "unknown arg 'num_rouns'" in lines[2][2]


def test_keys_the_refused_include_may_have_brought_are_not_reported_missing(tmp_path: Path) -> None:
    clean = SERVER.replace("num_rouns", "num_rounds").replace('"2MB"', "2097152")
    job = _job_with_server_config(tmp_path, clean.replace("format_version = 2\n", ""))

    problems = validate_job(job)

    assert len(problems) == 1 and "missing.conf" in problems[0].message  # no "missing required key format_version"


def test_a_file_that_needs_its_include_reports_the_include_alone(tmp_path: Path) -> None:
    text = 'include "missing.conf"\nformat_version = ${version}\nworkflows = []\ncomponents = []\n'
    job = _job_with_server_config(tmp_path, text)

    problems = validate_job(job)

    assert len(problems) == 1 and "missing.conf" in problems[0].message
