"""A job from someone else: read without running its code, and the reasons it brings code of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import inspect_job, job_code_of, load_job, validate_job
from engine.config.build import is_engine_component, resolve_dotted_path
from engine.errors import DottedPathError

from .sample_job import MODEL, MakeJob

REPO = Path(__file__).resolve().parents[3]
SERVER = "app/config/config_fed_server.conf"
CLIENT = "app/config/config_fed_client.conf"

# A job made of flengine's components only: no custom/ folder, every path inside engine's.
ENGINE_ONLY = {
    "app/custom/model.py": None,
    SERVER: """\
        format_version = 2
        workflows = [
          { id = fedavg, path = engine.workflows.FedAvg, args { num_clients = 2, num_rounds = 1 } }
        ]
        components = [
          { id = aggregator, path = engine.aggregators.DXOAggregator, args { expected_data_kind = WEIGHTS } }
          { id = shareable_generator, path = engine.workflows.FullModelShareableGenerator }
        ]
        task_result_filters = [
          { tasks = ["*"], filters = [{ path = engine.filters.ExcludeVars, args { exclude_vars = ["secret"] } }] }
        ]
        """,
    CLIENT: """\
        format_version = 2
        executors = [
          { tasks = ["cse_*"], executor { path = engine.executors.ccwf.CrossSiteEvalClientController } }
        ]
        """,
}


def _importing_writes(marker: Path) -> dict[str, str]:
    """The sample job, with job code that writes ``marker`` as soon as it is imported."""
    return {"app/custom/model.py": f"open({str(marker)!r}, 'w').close()\n{MODEL}"}


def test_a_job_read_without_building_runs_none_of_its_code(make_job: MakeJob, tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    job_dir = make_job(_importing_writes(marker))

    job, problems = inspect_job(job_dir, build=False, environment=False)

    assert problems == []
    assert job is not None and job.name == "demo"
    assert not marker.exists()


def test_a_job_built_by_default_runs_its_code(make_job: MakeJob, tmp_path: Path) -> None:
    # What `flengine validate` and `flengine run` do, and what a daemon must not do.
    marker = tmp_path / "imported"
    job_dir = make_job(_importing_writes(marker))

    job, problems = inspect_job(job_dir)

    assert problems == [] and job is not None
    assert marker.exists()


def test_without_building_every_check_that_needs_no_import_still_runs(make_job: MakeJob) -> None:
    job_dir = make_job(
        {
            SERVER: "format_version = 2\nworkflows = [{ id = wf, path = model.Nowhere, args { n = five } }]\n",
            CLIENT: None,
            "meta.conf": 'min_clients = 2\ndeploy_map { app = ["@ALL"], ghost = [site-1] }\n',
        }
    )

    problems = [str(p) for p in validate_job(job_dir, build=False)]

    # the missing class and its args would take an import to find; the rest does not
    assert problems == [
        "job/meta.conf:2: deploy_map.app: app 'app' goes to clients but has no config/config_fed_client.conf",
        "job/meta.conf:2: deploy_map.ghost: no app folder 'ghost' with a config/ folder (app folders in job: app)",
    ]


def test_a_job_that_brings_code_says_where(make_job: MakeJob) -> None:
    job = load_job(make_job(), build=False)

    reasons = job_code_of(job)

    assert reasons == [
        "app/custom/ (1 file)",
        f"{SERVER}:6: workflows[0].path = model.Workflow",
        f"{SERVER}:9: components[0].path = model.Persistor",
        f"{SERVER}:9: components[0].args.model.path = model.Net",
        f"{CLIENT}:3: executors[0].executor.path = model.Executor",
    ]


def test_the_fedavg_example_brings_its_own_code() -> None:
    job = load_job(REPO / "jobs" / "fedavg", build=False, environment=False)

    reasons = job_code_of(job)

    # Its training script is the job's own code; its model is the example's, a flengine component.
    assert reasons == ["app/custom/ (1 file)"]


def test_a_job_of_engine_components_brings_no_code(make_job: MakeJob) -> None:
    job_dir = make_job(ENGINE_ONLY)

    job = load_job(job_dir, build=False, environment=False)

    assert job_code_of(job) == []
    assert validate_job(job_dir) == []  # and it is a valid job, built as `flengine validate` builds it


def test_an_empty_custom_folder_brings_no_code(make_job: MakeJob) -> None:
    job_dir = make_job(ENGINE_ONLY)
    (job_dir / "app" / "custom" / "empty").mkdir(parents=True)

    assert job_code_of(load_job(job_dir, build=False)) == []


@pytest.mark.parametrize(
    ("component", "reason"),
    [
        pytest.param(
            "{ id = x, path = os.system, args { command = id } }",
            f"{SERVER}:8: components[2].path = os.system",
            id="standard-library",
        ),
        pytest.param(
            "{ id = x, path = engine.paths.os.system, args { command = id } }",
            f"{SERVER}:8: components[2].path = engine.paths.os.system",
            id="through-an-engine-module",
        ),
        pytest.param(
            "{ id = x, path = engine.config.build.build_component }",
            f"{SERVER}:8: components[2].path = engine.config.build.build_component",
            id="engine-machinery",
        ),
        pytest.param(
            "{ id = x, path = engine.workflows.FedAvg.__init__ }",
            f"{SERVER}:8: components[2].path = engine.workflows.FedAvg.__init__",
            id="dunder",
        ),
        pytest.param(
            "{ id = x, path = engine.workflows._private.Thing }",
            f"{SERVER}:8: components[2].path = engine.workflows._private.Thing",
            id="private",
        ),
        pytest.param(
            "{ id = x, path = engine.aggregators.DXOAggregator, args { helper = [1, { path = builtins.eval }] } }",
            f"{SERVER}:8: components[2].args.helper[1].path = builtins.eval",
            id="nested-in-a-list",
        ),
    ],
)
def test_a_path_outside_engine_components_is_job_code(make_job: MakeJob, component: str, reason: str) -> None:
    server = ENGINE_ONLY[SERVER].replace(
        "{ id = shareable_generator, path = engine.workflows.FullModelShareableGenerator }",
        "{ id = shareable_generator, path = engine.workflows.FullModelShareableGenerator }\n  " + component,
    )
    job = load_job(make_job({**ENGINE_ONLY, SERVER: server}), build=False)

    assert job_code_of(job) == [reason]


@pytest.mark.parametrize(
    ("path", "engine_component"),
    [
        pytest.param("engine.workflows.FedAvg", True, id="component"),
        pytest.param("engine.executors.ccwf.SwarmClientController", True, id="component-in-a-subpackage"),
        pytest.param("engine.persistors.pt_file.shutil.rmtree", True, id="through-a-component-module"),
        pytest.param("engine.config.job.Job", False, id="not-a-component-package"),
        pytest.param("engine.paths.os.system", False, id="through-an-engine-module"),
        pytest.param("engine.workflows.fedavg.__builtins__", False, id="dunder"),
        pytest.param("engine.workflowsx.Thing", False, id="package-prefix"),
        pytest.param("engine.workflows.Ｆed", False, id="not-ascii"),
        pytest.param("engine.examples.digits.Net", True, id="the-example-model"),
        pytest.param("net.Net", False, id="custom"),
        pytest.param("os.system", False, id="standard-library"),
    ],
)
def test_which_paths_are_engine_components(path: str, engine_component: bool) -> None:
    assert is_engine_component(path) is engine_component


@pytest.mark.parametrize(
    ("path", "message"),
    [
        pytest.param(
            "engine.paths.os.system",
            "'engine.paths.os.system' is not flengine's own: it is posix.system",
            id="function",
        ),
        pytest.param("engine.paths.os", "'engine.paths.os' is not flengine's own: it is the module os", id="module"),
        pytest.param(
            "engine.persistors.pt_file.shutil.rmtree",
            "'engine.persistors.pt_file.shutil.rmtree' is not flengine's own component: it is shutil.rmtree",
            id="from-a-component-module",
        ),
        pytest.param(
            "engine.executors.script_runners.SiteEndpoint",
            "'engine.executors.script_runners.SiteEndpoint' is not flengine's own component: "
            "it is engine.site.endpoint.SiteEndpoint",
            id="engine-class-that-is-no-component",
        ),
    ],
)
def test_a_path_into_engine_cannot_reach_past_it(path: str, message: str) -> None:
    with pytest.raises(DottedPathError) as caught:
        resolve_dotted_path(path)

    assert caught.value.message == message
    assert caught.value.hint == "a job may name engine classes or its own code in custom/"


def test_a_job_naming_an_engine_module_import_is_refused_at_build(make_job: MakeJob) -> None:
    server = ENGINE_ONLY[SERVER].replace("engine.workflows.FedAvg", "engine.paths.os.system")

    problems = [str(p) for p in validate_job(make_job({**ENGINE_ONLY, SERVER: server}))]

    assert problems == [
        "job/app/config/config_fed_server.conf:3: workflows[0].path: 'engine.paths.os.system' is not flengine's own: "
        "it is posix.system (a job may name engine classes or its own code in custom/)"
    ]


def test_engine_paths_that_are_engine_code_still_resolve() -> None:
    assert resolve_dotted_path("engine.workflows.FedAvg").__name__ == "FedAvg"
    assert resolve_dotted_path("engine.executors.ccwf.SwarmClientController").__module__.startswith("engine.executors")
