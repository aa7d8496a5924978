"""Building components: dotted paths, nested ``{path, args}``, constructor failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ComponentSpec, ConfigDocument, build_component, check_component, job_code_on_path
from engine.config.build import is_nested_component, resolve_dotted_path
from engine.errors import ComponentBuildError, ConfigError, DottedPathError

DOC = ConfigDocument(Path("c.conf"), "c.conf", {}, {("components", 0): 7})

JOB_CODE = """
from torch import nn


class Head(nn.Module):
    def __init__(self, width: int, classes: int = 10):
        super().__init__()
        self.linear = nn.Linear(width, classes)


class Holder:
    def __init__(self, model: nn.Module, extras: list | None = None, **options):
        self.model = model
        self.extras = extras
        self.options = options


class Angry:
    def __init__(self, level: int):
        raise RuntimeError(f"too angry at level {level}")


def make_head(width: int) -> Head:
    return Head(width)
"""


@pytest.fixture
def job_code(tmp_path: Path):
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "zoo.py").write_text(JOB_CODE, encoding="utf-8")
    with job_code_on_path(custom):
        yield


def spec(path: str, **args) -> ComponentSpec:
    return ComponentSpec(path, args, "c", ("components", 0))


def test_builds_nested_components_first(job_code: None) -> None:
    holder = build_component(
        spec(
            "zoo.Holder",
            model={"path": "zoo.Head", "args": {"width": 4}},
            extras=[{"path": "zoo.make_head", "args": {"width": 2}}, 5],
            color="blue",
        ),
        DOC,
    )

    assert isinstance(holder.model.linear, torch.nn.Linear)
    assert holder.model.linear.in_features == 4
    assert holder.extras[0].linear.in_features == 2
    assert holder.extras[1] == 5
    assert holder.options == {"color": "blue"}  # **options accepts any further arg


def test_real_engine_paths_resolve() -> None:
    assert resolve_dotted_path("torch.nn.Linear") is torch.nn.Linear
    assert resolve_dotted_path("engine.config.job.Job").__name__ == "Job"


def test_constructor_failure_names_the_place_and_chains_the_cause(job_code: None) -> None:
    with pytest.raises(ComponentBuildError) as caught:
        build_component(spec("zoo.Angry", level=3), DOC)

    assert str(caught.value) == "c.conf:7: components[0]: building zoo.Angry failed: RuntimeError: too angry at level 3"
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_build_refuses_what_check_finds(job_code: None) -> None:
    with pytest.raises(
        ConfigError, match=r"^c.conf:7: components\[0\].args.width: missing required arg 'width' for zoo.Head$"
    ):
        build_component(spec("zoo.Head"), DOC)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        pytest.param(
            "engine.no_such_layer.Thing",
            "cannot import 'engine.no_such_layer': no module named 'engine.no_such_layer'",
            id="missing-submodule",
        ),
        pytest.param(
            "torch.nn.Linearr",
            "cannot import 'torch.nn.Linearr': 'torch.nn' has no attribute 'Linearr'",
            id="missing-attribute",
        ),
        pytest.param(
            "zoo.Head.nope",
            "cannot import 'zoo.Head.nope': 'zoo.Head' has no attribute 'nope'",
            id="missing-nested-attribute",
        ),
    ],
)
def test_import_errors_say_module_or_attribute(job_code: None, path: str, message: str) -> None:
    problems = check_component(spec(path), DOC)

    assert [p.message for p in problems] == [message]


def test_missing_dependency_of_job_code_is_not_called_a_missing_module(tmp_path: Path) -> None:
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "needs.py").write_text("import not_installed_anywhere\n\nclass A: ...\n", encoding="utf-8")

    with job_code_on_path(custom):
        problems = check_component(spec("needs.A"), DOC)

    assert [p.message for p in problems] == [
        "importing 'needs' failed at needs.py:1: ModuleNotFoundError: No module named 'not_installed_anywhere'"
    ]


def test_job_code_leaves_no_trace(tmp_path: Path) -> None:
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "only_here.py").write_text("X = 1\n", encoding="utf-8")

    with job_code_on_path(custom):
        assert resolve_dotted_path("only_here.X") == 1

    import sys

    assert "only_here" not in sys.modules
    assert str(custom.resolve()) not in sys.path


@pytest.mark.parametrize(
    ("value", "nested"),
    [
        pytest.param({"path": "a.B"}, True, id="path-only"),
        pytest.param({"path": "a.B", "args": {"x": 1}}, True, id="path-and-args"),
        pytest.param({"path": "/data/train.csv"}, False, id="file-path-value"),
        pytest.param({"path": "a.B", "format": "csv"}, False, id="other-keys"),
        pytest.param("a.B", False, id="string"),
    ],
)
def test_which_arg_values_are_built(value: object, nested: bool) -> None:
    assert is_nested_component(value) is nested


@pytest.mark.parametrize(
    ("code", "message"),
    [
        pytest.param(
            "x = (\n", "importing 'faulty' failed at faulty.py:1: SyntaxError: '(' was never closed", id="syntax-error"
        ),
        pytest.param(
            "import json\n\njson.loads('{')\n",
            "importing 'faulty' failed at faulty.py:3: JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
            id="library-raises-points-at-job-line",
        ),
    ],
)
def test_import_failures_point_at_the_job_line(tmp_path: Path, code: str, message: str) -> None:
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "faulty.py").write_text(code, encoding="utf-8")

    with job_code_on_path(custom), pytest.raises(DottedPathError) as caught:
        resolve_dotted_path("faulty.Thing")

    assert caught.value.message == message
