"""Mistakes `flengine validate` catches before a run: an arg naming a file missing from custom/."""

from __future__ import annotations

import pytest

from engine.config import validate_job

from .sample_job import MODEL, MakeJob

C = "job/app/config/config_fed_client.conf"


def client_running(script: str, path: str = "engine.executors.ClientAPIExecutor") -> str:
    return (
        "format_version = 2\n"
        "executors = [\n"
        f'  {{ tasks = ["*"], executor {{ path = {path}, args {{ task_script_path = "{script}" }} }} }}\n'
        "]\n"
    )


SCRIPT_CASES = [
    pytest.param(
        {"app/custom/train.py": "", "app/config/config_fed_client.conf": client_running("trian.py")},
        f"{C}:3: executors[0].executor.args.task_script_path: no such file 'trian.py' in the app's custom/ "
        "folder (did you mean 'train.py'?)",
        id="typo-with-a-close-name",
    ),
    pytest.param(
        {"app/config/config_fed_client.conf": client_running("fit.py")},
        f"{C}:3: executors[0].executor.args.task_script_path: no such file 'fit.py' in the app's custom/ "
        "folder (put the file in the app's custom/ folder; the path is relative to it)",
        id="nothing-close",
    ),
    pytest.param(
        {"app/custom/scripts/train.py": "", "app/config/config_fed_client.conf": client_running("scripts/trian.py")},
        f"{C}:3: executors[0].executor.args.task_script_path: no such file 'scripts/trian.py' in the app's "
        "custom/ folder (did you mean 'scripts/train.py'?)",
        id="in-a-subfolder",
    ),
]


@pytest.mark.parametrize(("changes", "expected"), SCRIPT_CASES)
@pytest.mark.parametrize("build", [True, False], ids=["build", "no-build"])
def test_a_missing_task_script_is_a_problem_at_its_key(
    make_job: MakeJob, changes: dict[str, str], expected: str, build: bool
) -> None:
    job = make_job(changes)

    problems = validate_job(job, build=build)

    assert [str(p) for p in problems] == [expected]


def test_an_existing_task_script_is_no_problem(make_job: MakeJob) -> None:
    job = make_job({"app/custom/train.py": "", "app/config/config_fed_client.conf": client_running("train.py")})

    assert validate_job(job) == []


def test_an_app_without_custom_says_where_the_script_goes(make_job: MakeJob) -> None:
    job = make_job({"app/config/config_fed_client.conf": client_running("train.py")})
    (job / "app" / "custom" / "model.py").unlink()
    (job / "app" / "custom").rmdir()
    server = (job / "app" / "config" / "config_fed_server.conf").read_text()
    (job / "app" / "config" / "config_fed_server.conf").write_text(server.replace("model.", "engine.workflows."))

    problems = [p for p in validate_job(job, build=False) if p.file == C]

    assert [str(p) for p in problems] == [
        f"{C}:3: executors[0].executor.args.task_script_path: no such file 'train.py' in the app's custom/ "
        "folder (the app has no custom/ folder: create app/custom/ and put the file there)"
    ]


JOB_CLASS = """
class ScriptRunner:
    CUSTOM_FILE_ARGS = ("script",)

    def __init__(self, script: str):
        self.script = script
"""


def test_any_component_can_declare_its_custom_file_args(make_job: MakeJob) -> None:
    job = make_job(
        {
            "app/custom/model.py": MODEL + JOB_CLASS,
            "app/config/config_fed_client.conf": client_running("nope.py")
            .replace("engine.executors.ClientAPIExecutor", "model.ScriptRunner")
            .replace("task_script_path", "script"),
        }
    )

    built = [str(p) for p in validate_job(job, build=True)]
    unbuilt = [str(p) for p in validate_job(job, build=False)]

    assert built == [
        f"{C}:3: executors[0].executor.args.script: no such file 'nope.py' in the app's custom/ "
        "folder (did you mean 'model.py'?)"
    ]
    assert unbuilt == []  # the job's own class is not imported to find out


def test_without_build_the_jobs_code_is_not_imported(make_job: MakeJob, tmp_path) -> None:
    marker = tmp_path / "imported"
    job = make_job(
        {
            "app/custom/model.py": f"open({str(marker)!r}, 'w').close()\n" + MODEL + JOB_CLASS,
            "app/config/config_fed_client.conf": client_running("nope.py", "model.ScriptRunner"),
        }
    )

    validate_job(job, build=False)

    assert not marker.exists()
