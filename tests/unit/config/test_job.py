"""Whole job folders: every bad input the foundation issue lists yields its one exact line."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_job, validate_job
from engine.errors import ConfigError

from .sample_job import CLIENT, SERVER, MakeJob

S = "job/app/config/config_fed_server.conf"
C = "job/app/config/config_fed_client.conf"


def server_with(old: str, new: str) -> str:
    assert old in SERVER, old
    return SERVER.replace(old, new)


BAD_INPUT = [
    pytest.param(
        {"app/config/config_fed_server.conf": "format_version = 2\nworkflows = [\n  { id = wf\n"},
        [f"{S}:4: syntax error: Expected '}}' at column 1"],
        id="hocon-syntax-error",
    ),
    pytest.param(
        {"meta.conf": None, "meta.json": '{\n  "name": "demo",\n  "deploy_map": {"app": ["@ALL"]},\n}\n'},
        ["job/meta.json:4: invalid JSON: Expecting property name enclosed in double quotes at column 1"],
        id="json-syntax-error",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("format_version = 2\n", "")},
        [f"{S}: format_version: missing required key (add `format_version = 2`)"],
        id="missing-format-version",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": SERVER + "tensor_download_chunk_sise = 1\n"},
        [
            f"{S}:11: tensor_download_chunk_sise: unknown key 'tensor_download_chunk_sise' (did you mean "
            "'tensor_download_chunk_size'? accepted: cell, components, fold_wait_s, format_version, "
            "np_download_chunk_size, streaming_max_requests_in_flight, streaming_min_throughput, "
            "streaming_per_request_timeout, streaming_retries, streaming_retry_backoff_s, task_data_filters, "
            "task_result_filters, tensor_download_chunk_size, tensor_pool_idle_release_s, workflows)"
        ],
        id="unknown-top-level-key",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("= 2097152\nnp", '= "2MB"\nnp')},
        [
            f'{S}:2: tensor_download_chunk_size: expected an integer, got "2MB" '
            "(bytes as a plain integer, e.g. 2097152 for 2 MiB; 0 sends tensors inline)"
        ],
        id="chunk-size-string",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("= 2097152\nnp", "= -1\nnp")},
        [
            f"{S}:2: tensor_download_chunk_size: must be >= 0, got -1 "
            "(bytes as a plain integer, e.g. 2097152 for 2 MiB; 0 sends tensors inline)"
        ],
        id="chunk-size-negative",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("timeout = 600", "timeout = 0")},
        [f"{S}:4: streaming_per_request_timeout: must be > 0, got 0 (seconds, greater than 0, e.g. 600)"],
        id="timeout-zero",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("id = wf, path = model.Workflow,", "id = wf,")},
        [
            f"{S}:6: workflows[0].path: missing required key (add `path = module.Class`, the dotted path of the class to build)"
        ],
        id="component-without-path",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("path = model.Workflow", "path = modle.Workflow")},
        [
            f"{S}:6: workflows[0].path: cannot import 'modle.Workflow': no module named 'modle' "
            "(check the spelling; the job's own code goes in the app's custom/ folder)"
        ],
        id="path-module-missing",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("path = model.Workflow", "path = model.Workflw")},
        [
            f"{S}:6: workflows[0].path: cannot import 'model.Workflw': 'model' has no attribute 'Workflw' (did you mean 'Workflow'?)"
        ],
        id="path-attribute-missing",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("path = model.Workflow", "path = model.VALUE")},
        [
            f"{S}:6: workflows[0].path: 'model.VALUE' is an integer, not a class or function (point `path` at a class or factory function)"
        ],
        id="path-not-callable",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("num_rounds = 2", "num_rounds = 2, num_round = 3")},
        [
            f"{S}:6: workflows[0].args.num_round: unknown arg 'num_round' for model.Workflow "
            "(did you mean 'num_rounds'? accepted: num_rounds, persistor_id, weights)"
        ],
        id="unknown-arg",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("args { num_rounds = 2 }", "args { persistor_id = p }")},
        [f"{S}:6: workflows[0].args.num_rounds: missing required arg 'num_rounds' for model.Workflow"],
        id="missing-required-arg",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("id = persistor", "id = wf")},
        [f"{S}:9: components[0].id: duplicate id 'wf', first used at line 6 (ids must be unique in a config file)"],
        id="duplicate-id",
    ),
    pytest.param(
        {"meta.conf": 'name = demo\ndeploy_map {\n  app = ["@ALL"]\n  app2 = [site-2]\n}\n'},
        ["job/meta.conf:4: deploy_map.app2: no app folder 'app2' with a config/ folder (app folders in job: app)"],
        id="deploy-map-missing-app",
    ),
    pytest.param(
        {"app/config/config_fed_client.json": '{"format_version": 2}'},
        ["job/app/config: both config_fed_client.conf and config_fed_client.json exist (keep one of them)"],
        id="conf-and-json",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": 'include "../../../secrets.conf"\n' + SERVER},
        [
            f"{S}:1: include '../../../secrets.conf' reaches outside the job folder 'job' "
            "(copy the shared file into the job folder)"
        ],
        id="include-outside-job",
    ),
]


@pytest.mark.parametrize(("changes", "expected"), BAD_INPUT)
def test_bad_input_yields_its_exact_line(make_job: MakeJob, changes: dict, expected: list[str]) -> None:
    job = make_job(changes)

    problems = validate_job(job)

    assert [str(p) for p in problems] == expected


def test_empty_job_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("empty").mkdir()

    problems = validate_job("empty")

    assert [str(p) for p in problems] == [
        "empty: the job folder is empty (a job needs meta.conf and an app folder with "
        "config/config_fed_server.conf and config/config_fed_client.conf)"
    ]


def test_missing_job_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    assert [str(p) for p in validate_job("nowhere")] == ["nowhere: no such job folder"]


def test_valid_job_loads_with_defaults(make_job: MakeJob) -> None:
    job_dir = make_job({"meta.conf": 'deploy_map { app = ["@ALL"] }\n'})

    job = load_job(job_dir)

    assert job.name == "job"  # defaults to the folder's name
    assert job.min_clients == 1
    server = job.app_for("server").server
    assert server.data["task_data_filters"] == []
    assert server.data["streaming_per_request_timeout"] == 600
    assert job.app_for("site-7").client.data["tensor_download_chunk_size"] == 2097152


def test_load_job_raises_every_problem_at_once(make_job: MakeJob) -> None:
    job_dir = make_job(
        {
            "app/config/config_fed_server.conf": server_with("timeout = 600", "timeout = 0"),
            "app/config/config_fed_client.conf": CLIENT.replace("script = train.py", "scrpt = train.py"),
        }
    )

    with pytest.raises(ConfigError) as caught:
        load_job(job_dir)

    lines = str(caught.value).splitlines()
    assert lines[0].startswith(f"{S}:4: streaming_per_request_timeout: must be > 0")
    assert lines[1].startswith(f"{C}:3: executors[0].executor.args.scrpt: unknown arg 'scrpt'")
    assert lines[2] == f"{C}:3: executors[0].executor.args.script: missing required arg 'script' for model.Executor"
    assert len(lines) == 3


MORE_CASES = [
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("num_rounds = 2", 'num_rounds = "five"')},
        [f'{S}:6: workflows[0].args.num_rounds: expected an integer, got "five"'],
        id="arg-wrong-type",
    ),
    pytest.param(
        {"app/config/config_fed_client.conf": CLIENT.replace("script = train.py", "script = train.py, mode = thread")},
        [f'{C}:3: executors[0].executor.args.mode: expected one of "in_process", "subprocess", got "thread"'],
        id="arg-not-in-literal",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("args { hidden = 8 }", "args { hidden = true }")},
        [f"{S}:9: components[0].args.model.args.hidden: expected an integer, got True"],
        id="nested-component-arg",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("path = model.Net", "path = model.Nte")},
        [
            f"{S}:9: components[0].args.model.path: cannot import 'model.Nte': 'model' has no attribute 'Nte' (did you mean 'Net'?)"
        ],
        id="nested-component-path",
    ),
    pytest.param(
        {
            "app/custom/broken.py": "x = 1 / 0\n",
            "app/config/config_fed_server.conf": server_with("model.Workflow", "broken.Workflow"),
        },
        [f"{S}:6: workflows[0].path: importing 'broken' failed at broken.py:1: ZeroDivisionError: division by zero"],
        id="job-code-raises-on-import",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("path = model.Workflow", "name = Workflow")},
        [
            f"{S}:6: workflows[0].path: missing required key (add `path = module.Class`, the dotted path of the class to build)",
            f"{S}:6: workflows[0].name: unknown key 'name' (components are built from a dotted `path`; "
            "flengine does not look classes up by name)",
        ],
        id="name-instead-of-path",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": server_with("path = model.Workflow", "path = Workflow")},
        [f'{S}:6: workflows[0].path: "Workflow" is not a dotted path (write module.Class, e.g. model.Net)'],
        id="path-not-dotted",
    ),
    pytest.param(
        {"meta.conf": "deploy_map { app = [site-1] }\n"},
        ['job/meta.conf:1: deploy_map: no app is deployed to the server (add "server" or "@ALL" to one app\'s sites)'],
        id="nothing-on-server",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": None},
        ["job/meta.conf:3: deploy_map.app: app 'app' goes to the server but has no config/config_fed_server.conf"],
        id="server-app-without-server-config",
    ),
    pytest.param(
        {"meta.conf": 'deploy_map { app = ["@ALL"] }\nmin_clients = 0\n'},
        ["job/meta.conf:2: min_clients: must be >= 1, got 0"],
        id="meta-min-clients",
    ),
    pytest.param(
        {"app/config/config_fed_server.conf": SERVER + "x = ${undefined}\n"},
        [f"{S}:11: cannot resolve variable ${{undefined}} (define it, or write ${{?NAME}} to make it optional)"],
        id="unresolved-substitution",
    ),
    pytest.param(
        {
            "app/config/config_fed_server.conf": server_with(
                "path = model.Workflow, args { num_rounds = 2 }",
                'path = engine.workflows.FedAvg, args { num_rounds = 2, download_to_disk = "yes" }',
            )
        },
        [f'{S}:6: workflows[0].args.download_to_disk: expected true or false, got "yes" (true or false)'],
        id="download-to-disk-said-once",
    ),
    pytest.param(
        {
            "app/config/config_fed_server.conf": server_with(
                "path = model.Workflow, args { num_rounds = 2 }",
                'path = engine.workflows.ScatterAndGather, args { download_to_disk_dir = "" }',
            )
        },
        [
            f"{S}:6: workflows[0].args.download_to_disk_dir: must not be empty "
            "(a folder path under the server's workspace, e.g. downloads, or inside a folder the site allows with --allow-dir)"
        ],
        id="download-to-disk-dir-empty",
    ),
]


@pytest.mark.parametrize(("changes", "expected"), MORE_CASES)
def test_more_bad_input(make_job: MakeJob, changes: dict, expected: list[str]) -> None:
    job = make_job(changes)

    assert [str(p) for p in validate_job(job)] == expected


def test_json_configs_work_like_hocon(make_job: MakeJob) -> None:
    server_json = """{
      "format_version": 2,
      "workflows": [{"id": "wf", "path": "model.Workflow", "args": {"num_rounds": "two"}}]
    }"""
    job = make_job({"app/config/config_fed_server.conf": None, "app/config/config_fed_server.json": server_json})

    assert [str(p) for p in validate_job(job)] == [
        'job/app/config/config_fed_server.json:3: workflows[0].args.num_rounds: expected an integer, got "two"'
    ]


def test_two_jobs_with_same_module_name_do_not_mix(make_job: MakeJob) -> None:
    first = make_job(name="first")
    second = make_job(
        {"app/custom/model.py": "class Workflow:\n    def __init__(self, rounds: int): ...\n\n\nExecutor = dict\n"}
        | {
            "app/config/config_fed_server.conf": server_with("num_rounds = 2", "rounds = 2").replace(
                "{ id = persistor, path = model.Persistor, args { model { path = model.Net, args { hidden = 8 } } } }",
                "",
            )
        },
        name="second",
    )

    assert validate_job(first) == []
    assert validate_job(second) == []
    assert validate_job(first) == []
