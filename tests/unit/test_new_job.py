"""``flengine new``: each template writes a job folder that validates, runs, and explains every key."""

from __future__ import annotations

import io
import json
import re
from importlib import resources
from pathlib import Path

import pytest

from engine.cli import main
from engine.config import validate_job
from engine.config.new_job import TEMPLATES, new_job
from engine.errors import UsageError
from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState

CONFIGS = ("meta.conf", "app/config/config_fed_server.conf", "app/config/config_fed_client.conf")
FILES = [
    "app/config/config_fed_client.conf",
    "app/config/config_fed_server.conf",
    "app/custom/train.py",
    "meta.conf",
]
KEY_LINE = re.compile(r"^\s*[A-Za-z_][\w.]*\s*(=|\{.*\}\s*$)")  # `key = value` or `key { ... }` on one line


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_each_template_writes_a_valid_job_named_after_its_folder(tmp_path: Path, template: str) -> None:
    job = new_job("my-job", template, parent=tmp_path)

    assert job.folder == tmp_path / "my-job"
    assert job.files == FILES
    assert validate_job(job.folder) == []
    assert 'name = "my-job"' in (job.folder / "meta.conf").read_text().splitlines()


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_every_key_of_every_config_has_a_comment(tmp_path: Path, template: str) -> None:
    job = new_job("commented", template, parent=tmp_path)

    bare = []
    for name in CONFIGS:
        previous = ""
        for number, line in enumerate((job.folder / name).read_text().splitlines(), 1):
            if KEY_LINE.match(line) and "#" not in line and not previous.lstrip().startswith("#"):
                bare.append(f"{template}/{name}:{number}: {line.strip()}")
            if line.strip():
                previous = line

    assert bare == []


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_rounds_sets_num_rounds_of_the_training_workflow(tmp_path: Path, template: str) -> None:
    job = new_job("short", template, parent=tmp_path, num_rounds=1)

    server = (job.folder / "app/config/config_fed_server.conf").read_text()

    assert re.findall(r"num_rounds = (\d+)", server) == ["1"]
    assert validate_job(job.folder) == []


def test_cli_writes_the_job_and_reports_it_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["new", "digits", "--template", "swarm", "--dir", str(tmp_path), "--format", "json"])

    assert code == 0
    assert json.loads(capsys.readouterr().out) == {
        "job": str(tmp_path / "digits"),
        "template": "swarm",
        "files": FILES,
    }
    assert (tmp_path / "digits" / "app/custom/train.py").stat().st_size > 0


def test_cli_text_lists_the_files_and_what_to_run_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)

    code = main(["new", "demo"])

    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0] == "wrote job demo (fedavg) in demo:"
    assert out[1:-1] == [f"  {file}" for file in FILES]
    assert out[-1] == "next: flengine validate demo && flengine run demo"


def test_an_empty_folder_is_filled(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()

    job = new_job("empty", parent=tmp_path)

    assert (job.folder / "meta.conf").is_file()


@pytest.mark.parametrize("occupant", ["folder-with-a-file", "a-file"])
def test_an_existing_folder_or_file_is_refused_and_left_alone(
    tmp_path: Path, occupant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    if occupant == "a-file":
        taken.write_text("mine")
    else:
        taken.mkdir()
        (taken / "notes.txt").write_text("mine")

    code = main(["new", "taken", "--dir", str(tmp_path)])

    assert code == 2
    assert capsys.readouterr().err.startswith(f"Error: {taken}: already exists and is ")
    assert sorted(p.name for p in tmp_path.rglob("*")) == (
        ["taken"] if occupant == "a-file" else ["notes.txt", "taken"]
    )


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("a/b", id="slash"),
        pytest.param("..", id="parent"),
        pytest.param("../escape", id="climbs-out"),
        pytest.param(".hidden", id="dot-first"),
        pytest.param("-x", id="dash-first"),
        pytest.param("", id="empty"),
        pytest.param("with space", id="space"),
    ],
)
def test_a_name_that_is_not_a_plain_folder_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError, match=r"^job name .*: expected a plain folder name"):
        new_job(name, parent=tmp_path)

    assert list(tmp_path.iterdir()) == []


def test_bad_rounds_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"^rounds: expected a positive integer, got 0$"):
        new_job("zero", parent=tmp_path, num_rounds=0)


def test_an_unknown_template_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["new", "job", "--template", "fedprox", "--dir", str(tmp_path)])

    assert caught.value.code == 2
    assert "invalid choice: 'fedprox' (choose from 'fedavg', 'swarm', 'cse')" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def run_new_job(tmp_path: Path, template: str) -> Path:
    job = new_job(template, template, parent=tmp_path / "jobs", num_rounds=1)
    result = run_simulation(job.folder, n_clients=2, workspace=tmp_path / "ws", out=io.StringIO())
    assert result.state is JobState.FINISHED_COMPLETED, result.summary
    return result.workspace


def test_the_fedavg_job_runs_to_completion(tmp_path: Path) -> None:
    workspace = run_new_job(tmp_path, "fedavg")

    assert (workspace / "server" / "models" / "global.safetensors").is_file()
    for index, site in enumerate(["site-1", "site-2"]):  # each client knew its place among the job's sites
        assert (
            f"job sites site={site} index={index} of=2 sites=site-1,site-2"
            in (workspace / site / "log.txt").read_text()
        )


def test_the_training_script_is_a_copy_of_the_engines_example_to_edit(tmp_path: Path) -> None:
    job = new_job("digits", parent=tmp_path)

    script = (job.folder / "app/custom/train.py").read_text(encoding="utf-8")

    assert script == resources.files("engine.examples").joinpath("train.py").read_text(encoding="utf-8")
    assert "flare.get_site_index()" in script and "get_site_name" not in script  # the shard never from the name
    assert len(script.splitlines()) <= 90, "the template's script is a plain loop, read in a minute"


@pytest.mark.slow
def test_the_swarm_job_runs_to_completion(tmp_path: Path) -> None:
    workspace = run_new_job(tmp_path, "swarm")

    assert (workspace / "site-1" / "models" / "global.safetensors").is_file()


@pytest.mark.slow
def test_the_cse_job_runs_to_completion_with_a_full_matrix(tmp_path: Path) -> None:
    workspace = run_new_job(tmp_path, "cse")

    matrix = json.loads((workspace / "server" / "cross_site_val.json").read_text())
    assert sorted(matrix) == ["site-1", "site-2"]
    assert all(sorted(row) == ["global (site-1)", "site-1", "site-2"] for row in matrix.values())
    assert all("accuracy" in metrics for row in matrix.values() for metrics in row.values())
