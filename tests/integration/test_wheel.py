"""A non-editable install carries the schemas and every subpackage, and validates from anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel from a copy of the sources and install it, alone, into a target folder."""
    pytest.importorskip("setuptools", minversion="64", reason="building the wheel needs setuptools>=64")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", "__pycache__", ".ci"))
    built = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(work / "dist"),
        ".",
        cwd=source,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next((work / "dist").glob("flengine-*.whl"))
    target = work / "site"
    done = run(
        sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel), cwd=work
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return target


def python_with(target: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # The target folder comes first on sys.path, so `engine` is the installed copy, not the checkout.
    env = {**os.environ, "PYTHONPATH": str(target)}
    return run(sys.executable, *args, cwd=cwd, env=env)


def test_wheel_holds_every_subpackage_and_the_schemas(installed: Path) -> None:
    source_packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "engine").rglob("__init__.py")}
    wheel_packages = {p.parent.relative_to(installed).as_posix() for p in (installed / "engine").rglob("__init__.py")}

    assert wheel_packages == source_packages | {"engine/schemas"}
    schemas = sorted(p.name for p in (installed / "engine" / "schemas").glob("*.schema.json"))
    assert schemas == sorted(p.name for p in (REPO / "schemas").glob("*.schema.json"))
    assert (installed / "engine" / "py.typed").is_file()


def test_wheel_holds_every_file_of_the_job_templates(installed: Path) -> None:
    templates = REPO / "engine" / "templates"
    source_files = {
        p.relative_to(templates).as_posix()
        for p in templates.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != "__init__.py"
    }
    wheel_templates = installed / "engine" / "templates"
    wheel_files = {
        p.relative_to(wheel_templates).as_posix()
        for p in wheel_templates.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != "__init__.py"
    }

    assert wheel_files == source_files
    assert (installed / "engine" / "examples" / "train.py").is_file()  # the templates' training script
    assert (installed / "engine" / "examples" / "data" / "digits.csv.gz").stat().st_size > 0


def test_installed_wheel_validates_a_job_from_another_folder(installed: Path, tmp_path: Path) -> None:
    shutil.copytree(REPO / "jobs" / "fedavg", tmp_path / "fedavg")

    where = python_with(installed, "-c", "import engine; print(engine.__file__)", cwd=tmp_path)
    result = python_with(installed, "-m", "engine", "validate", "fedavg", cwd=tmp_path)

    assert where.stdout.strip() == str(installed / "engine" / "__init__.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == "fedavg: ok\n"


def test_installed_wheel_writes_a_new_job_that_validates(installed: Path, tmp_path: Path) -> None:
    made = python_with(installed, "-m", "engine", "new", "digits", "--template", "cse", cwd=tmp_path)
    result = python_with(installed, "-m", "engine", "validate", "digits", cwd=tmp_path)

    assert made.returncode == 0, made.stdout + made.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == "digits: ok\n"
