"""Every path a job's config names stays in the folder it belongs to (issue 27).

Each path arg of flengine's own components is given hostile values (``../../x``, an absolute path
outside, a symbolic link inside the folder that points out) and must be refused, naming the
setting, before anything is written: when the config is built, or at job start.

================================  ======================================  ===============================
Path arg                          Must stay in                            Checked
================================  ======================================  ===============================
PTFileModelPersistor
  global_model_file_name          <site workspace>/models (a name alone)  constructor; ``use_workspace``
  best_global_model_file_name     <site workspace>/models (a name alone)  constructor; ``use_workspace``
  source_ckpt_file_full_name      job folder, workspace, allowed folders  ``use_job_paths``
CrossSiteEvalServerController
  result_file                     the server's workspace folder           constructor; ``use_job_paths``;
                                                                          before the write
SwarmClientController
  download_to_disk_dir            the client's workspace, allowed folders ``use_job_paths``; config task
ClientAPIExecutor
  task_script_path                the app's custom/ folder                ``use_job_paths``; ``initialize``
================================  ======================================  ===============================
"""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.config import ConfigDocument
from engine.controller import TaskQueue
from engine.controller.context import JobContext
from engine.errors import ConfigError, PathOutsideError
from engine.executors.ccwf import SwarmClientController
from engine.executors.client_api import ClientAPIExecutor
from engine.executors.executor import ExecutorContext
from engine.model import FLModel, ReturnCode, Shareable, shareable_from_model
from engine.model.ccwf import GLOBAL_MODELS_KEY
from engine.paths import JobPaths
from engine.persistors import PTFileModelPersistor
from engine.runtime.assembly import ExecutorRoute, prepare_components, prepare_executors
from engine.runtime.simulator import run_simulation
from engine.runtime.states import JobState
from engine.workflows.ccwf import CrossSiteEvalServerController
from tests.integration.runtime.conftest import processes_mentioning
from tests.integration.runtime.jobkit import make_bench_job

ALLOW_FIX = "give a path inside one, or let the site allow a folder that holds it (flengine run --allow-dir DIR)"
JOB_FOLDERS = "the job folder, the site's workspace and the folders the site allows"
OUTPUT_FOLDERS = "the site's workspace and the folders the site allows"


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)


@dataclass
class Site:
    """A job's folders on a site, and a folder outside all of them."""

    job: Path
    app: Path
    custom: Path
    workspace: Path
    outside: Path
    paths: JobPaths


@pytest.fixture
def site(tmp_path: Path) -> Site:
    job, workspace, outside = tmp_path / "job", tmp_path / "ws" / "site-1", tmp_path / "outside"
    for folder in (job / "app" / "custom", workspace, outside):
        folder.mkdir(parents=True)
    paths = JobPaths(job / "app", job, workspace)
    return Site(job, job / "app", job / "app" / "custom", workspace, outside, paths)


def refused(call, *args, **kwargs) -> str:
    """The message of the `PathOutsideError` that ``call(*args, **kwargs)`` raises."""
    with pytest.raises(PathOutsideError) as caught:
        call(*args, **kwargs)
    return str(caught.value)


# ----------------------------------------------------------------- values that stay inside


def test_paths_that_stay_inside_are_accepted(site: Site) -> None:
    (site.custom / "train.py").write_text("")
    (site.workspace / "inner").mkdir()
    (site.workspace / "to_inner").symlink_to(site.workspace / "inner")  # a link that stays inside

    PTFileModelPersistor(model=Net(), global_model_file_name="g.safetensors").use_workspace(site.workspace)
    CrossSiteEvalServerController(result_file="to_inner/../r/cse.json").use_job_paths(site.paths)
    CrossSiteEvalServerController(result_file="to_inner/cse.json").use_job_paths(site.paths)
    SwarmClientController(download_to_disk=True, download_to_disk_dir="to_inner/dl").use_job_paths(site.paths)
    SwarmClientController(download_to_disk=False, download_to_disk_dir="/unused").use_job_paths(site.paths)
    ClientAPIExecutor(task_script_path="train.py").use_job_paths(site.paths)


# ----------------------------------------------------------------- persistor file names


@pytest.mark.parametrize("setting", ["global_model_file_name", "best_global_model_file_name"])
@pytest.mark.parametrize("value", ["../../x", "{outside}/x.safetensors", "..", "models/x"])
def test_a_checkpoint_file_name_that_is_not_a_plain_name_is_refused_when_built(
    site: Site, setting: str, value: str
) -> None:
    value = value.format(outside=site.outside)

    message = refused(PTFileModelPersistor, model=Net(), **{setting: value})

    assert message == (
        f"{setting}: expected a plain file name (it goes in the models folder), got {value!r}; "
        "give the file name alone (no folder, no '..')"
    )


@pytest.mark.parametrize(
    ("setting", "name"),
    [("global_model_file_name", "global.safetensors"), ("best_global_model_file_name", "best_global.safetensors")],
)
def test_a_checkpoint_file_linked_out_of_the_workspace_is_refused_at_job_start(
    site: Site, setting: str, name: str
) -> None:
    (site.workspace / "models").mkdir()
    (site.workspace / "models" / name).symlink_to(site.outside / name)
    persistor = PTFileModelPersistor(model=Net())

    message = refused(persistor.use_workspace, site.workspace)

    assert message == (
        f"{setting}: {site.workspace / 'models' / name} leads to {site.outside.resolve() / name} through a "
        f"symbolic link, outside the site's workspace {site.workspace.resolve()}; remove the link or make it point inside"
    )


def test_a_models_folder_linked_out_of_the_workspace_is_refused_and_nothing_is_deleted_there(site: Site) -> None:
    (site.workspace / "models").symlink_to(site.outside)
    left = site.outside / ".global.safetensors.abc123.tmp"  # looks like a crashed save's temp file
    left.write_bytes(b"someone else's")
    persistor = PTFileModelPersistor(model=Net())

    message = refused(persistor.use_workspace, site.workspace)

    assert message.startswith(
        f"global_model_file_name: {site.workspace / 'models' / 'global.safetensors'} leads to "
        f"{site.outside.resolve() / 'global.safetensors'} through a symbolic link, outside the site's workspace"
    )
    assert left.read_bytes() == b"someone else's"


def test_a_models_folder_linked_out_after_the_start_is_refused_before_a_save(site: Site) -> None:
    persistor = PTFileModelPersistor(model=Net())
    persistor.use_workspace(site.workspace)  # fine at the start
    (site.workspace / "models").symlink_to(site.outside)
    model = FLModel(params={"fc.weight": torch.zeros(1, 2), "fc.bias": torch.zeros(1)})

    message = refused(persistor.save_model, model)

    assert message.startswith(f"global_model_file_name: {site.workspace / 'models' / 'global.safetensors'} leads to ")
    assert list(site.outside.iterdir()) == []


def test_a_checkpoint_file_name_is_refused_in_the_runtime_at_its_file_line_and_key(site: Site) -> None:
    (site.workspace / "models").symlink_to(site.outside)
    document = ConfigDocument(
        site.app / "config" / "s.conf", "job/app/config/s.conf", {}, {("components", 0, "args"): 7}
    )

    with pytest.raises(ConfigError) as caught:
        prepare_components({"persistor": PTFileModelPersistor(model=Net())}, document, site.workspace, site.paths)

    assert str(caught.value).startswith(
        "job/app/config/s.conf:7: components[0].args.global_model_file_name: "
        f"{site.workspace / 'models' / 'global.safetensors'} leads to "
    )
    assert isinstance(caught.value.__cause__, PathOutsideError)


# ----------------------------------------------------------------- persistor checkpoint to start from


@pytest.mark.parametrize("value", ["../../x", "{outside}/x.safetensors", "custom/link.safetensors"])
def test_a_source_checkpoint_outside_the_job_is_refused_at_job_start(site: Site, value: str) -> None:
    (site.custom / "link.safetensors").symlink_to(site.outside / "x.safetensors")
    value = value.format(outside=site.outside)
    persistor = PTFileModelPersistor(model=Net(), source_ckpt_file_full_name=value)

    message = refused(persistor.use_job_paths, site.paths)

    target = (site.app / value).resolve()
    folders = f"{site.job.resolve()}, {site.workspace.resolve()}"
    assert message == (
        f"source_ckpt_file_full_name: {value!r} leads to {target}, outside {JOB_FOLDERS} ({folders}); {ALLOW_FIX}"
    )


# ----------------------------------------------------------------- cross-site evaluation's result file


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ("../../x", "'../../x' climbs out of {folder} with '..'; give a path inside {folder}"),
        ("a/../../x", "'a/../../x' climbs out of {folder} with '..'; give a path inside {folder}"),
        ("/tmp/x.json", "'/tmp/x.json' is absolute; give a path relative to {folder}"),
    ],
    ids=["dot-dot", "dot-dot-inside", "absolute"],
)
def test_a_cross_site_result_file_leaving_the_workspace_is_refused_when_built(value: str, detail: str) -> None:
    message = refused(CrossSiteEvalServerController, result_file=value)

    assert message == "result_file: " + detail.format(folder="the server's workspace folder")


def test_a_cross_site_result_file_linked_out_is_refused_at_job_start(site: Site) -> None:
    (site.workspace / "results").symlink_to(site.outside)
    workflow = CrossSiteEvalServerController(result_file="results/cse.json")

    message = refused(workflow.use_job_paths, site.paths)

    assert message == (
        f"result_file: 'results/cse.json' leads to {site.outside.resolve() / 'cse.json'}, outside the server's "
        f"workspace folder {site.workspace.resolve()}; give a path inside the server's workspace folder"
    )


def test_a_cross_site_result_file_linked_out_after_the_start_is_refused_before_it_is_written(site: Site) -> None:
    workflow = CrossSiteEvalServerController(global_model_client="site-1", evaluatees="@none", result_file="r/m.json")
    workflow.use_job_paths(site.paths)  # fine at the start
    (site.workspace / "r").symlink_to(site.outside)
    queue = TaskQueue(["site-1"])
    workflow.bind(queue, context=JobContext(workspace=site.workspace))
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run_catching(workflow.run, errors), daemon=True)
    thread.start()

    holder = Shareable({GLOBAL_MODELS_KEY: ["global"]})
    holder.set_return_code(ReturnCode.OK)
    _answer(queue, "site-1", "cse_config", holder)
    evaluated = shareable_from_model(FLModel(metrics={"accuracy": 0.5}))
    evaluated.set_return_code(ReturnCode.OK)
    _answer(queue, "site-1", "cse_eval", evaluated)
    thread.join(10)
    queue.end_run()

    assert not thread.is_alive()
    [error] = errors
    assert isinstance(error, PathOutsideError) and str(error).startswith("result_file: 'r/m.json' leads to ")
    assert list(site.outside.iterdir()) == []


def _run_catching(run, errors: list[BaseException]) -> None:
    try:
        run()
    except BaseException as e:  # noqa: BLE001 - handed to the test
        errors.append(e)


def _answer(queue: TaskQueue, site: str, task_name: str, result: Shareable) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assignment = queue.next_task(site)
        if assignment is not None:
            assert assignment.task_name == task_name
            queue.submit(site, assignment.task_id, result)
            return
        time.sleep(0.01)
    raise AssertionError(f"{site} got no {task_name} task")


# ----------------------------------------------------------------- Swarm's download folder


@pytest.mark.parametrize("value", ["../../x", "{outside}/dl", "link/dl"], ids=["dot-dot", "absolute", "symlink-out"])
def test_a_swarm_download_folder_outside_the_workspace_is_refused_at_job_start(site: Site, value: str) -> None:
    (site.workspace / "link").symlink_to(site.outside)
    value = value.format(outside=site.outside)
    controller = SwarmClientController(download_to_disk=True, download_to_disk_dir=value)

    message = refused(controller.use_job_paths, site.paths)

    target = (site.workspace / value).resolve()
    assert message == (
        f"download_to_disk_dir: {value!r} leads to {target}, outside {OUTPUT_FOLDERS} "
        f"({site.workspace.resolve()}); {ALLOW_FIX}"
    )
    assert list(site.outside.iterdir()) == []


def test_a_swarm_download_folder_in_an_allowed_folder_is_accepted(site: Site) -> None:
    paths = JobPaths(site.app, site.job, site.workspace, (site.outside,))
    controller = SwarmClientController(download_to_disk=True, download_to_disk_dir=str(site.outside / "dl"))

    controller.use_job_paths(paths)


# ----------------------------------------------------------------- the Client API executor's script


@pytest.mark.parametrize("value", ["../../x.py", "{outside}/x.py", "link.py"], ids=["dot-dot", "absolute", "symlink"])
def test_a_task_script_outside_custom_is_refused_at_job_start_and_at_initialize(site: Site, value: str) -> None:
    (site.outside / "x.py").write_text("raise SystemExit('not the job')\n")
    (site.custom / "link.py").symlink_to(site.outside / "x.py")
    value = value.format(outside=site.outside)
    executor = ClientAPIExecutor(task_script_path=value)
    context = ExecutorContext("site-1", "job-1", site.workspace, site.custom)

    at_start = refused(executor.use_job_paths, site.paths)
    at_initialize = refused(executor.initialize, context)

    target = (site.custom / value).resolve()
    expected = (
        f"task_script_path: {value!r} leads to {target}, outside the app's custom/ folder {site.custom.resolve()}; "
        "give a path inside the app's custom/ folder"
    )
    assert at_start == at_initialize == expected


def test_an_executor_path_is_refused_in_the_runtime_at_its_file_line_and_key(site: Site) -> None:
    routes = [
        ExecutorRoute(["train"], ClientAPIExecutor(task_script_path="train.py")),
        ExecutorRoute(["swarm_*"], SwarmClientController(download_to_disk=True, download_to_disk_dir="/etc/dl")),
    ]
    (site.custom / "train.py").write_text("")
    key_lines = {("executors", 1, "executor", "args", "download_to_disk_dir"): 12}
    document = ConfigDocument(site.app / "config" / "c.conf", "job/app/config/c.conf", {}, key_lines)

    with pytest.raises(ConfigError) as caught:
        prepare_executors(routes, document, site.paths)

    assert str(caught.value).startswith(
        "job/app/config/c.conf:12: executors[1].executor.args.download_to_disk_dir: '/etc/dl' leads to /etc/dl, "
        f"outside {OUTPUT_FOLDERS}"
    )
    assert isinstance(caught.value.__cause__, PathOutsideError)


def test_a_workflow_path_is_refused_in_the_runtime_at_its_file_line_and_key(site: Site) -> None:
    (site.workspace / "results").symlink_to(site.outside)
    workflows = {"cse": CrossSiteEvalServerController(result_file="results/cse.json")}
    document = ConfigDocument(site.app / "config" / "s.conf", "job/app/config/s.conf", {}, {("workflows", 0): 3})

    with pytest.raises(ConfigError) as caught:
        prepare_components(workflows, document, site.workspace, site.paths, key="workflows")

    assert str(caught.value).startswith("job/app/config/s.conf:3: workflows[0].args.result_file: 'results/cse.json'")


# ----------------------------------------------------------------- a real job


def test_a_job_whose_persistor_file_leaves_the_workspace_ends_with_the_setting_and_writes_nothing_outside(
    tmp_path: Path,
) -> None:
    job = make_bench_job(tmp_path, num_rounds=1, num_clients=1, layers=1, width=4)
    config = job / "app" / "config" / "config_fed_server.conf"
    persistor = "path = engine.persistors.PTFileModelPersistor, args {"
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace(persistor, f'{persistor} global_model_file_name = "../../escape.safetensors",'))
    workspace = tmp_path / "workspace"

    result = run_simulation(job, 1, workspace, out=io.StringIO())

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION
    reason = json.loads((workspace / "summary.json").read_text(encoding="utf-8"))["reason"]
    assert "config_fed_server.conf:" in reason and "components[0]" in reason, reason
    assert (
        "PathOutsideError: global_model_file_name: expected a plain file name (it goes in the models folder), "
        "got '../../escape.safetensors'; give the file name alone (no folder, no '..')"
    ) in reason
    assert not list(tmp_path.rglob("escape.safetensors"))
    assert processes_mentioning(str(tmp_path)) == []
