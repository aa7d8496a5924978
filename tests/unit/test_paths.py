"""Paths from a job stay inside the folders a site allows: one folder, several, and a job's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import PathOutsideError
from engine.paths import JobPaths, path_inside_any


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    """A workspace, an allowed folder and a folder nobody allowed, with a link from the first to the last."""
    made = {name: tmp_path / name for name in ("workspace", "scratch", "elsewhere")}
    for folder in made.values():
        folder.mkdir()
    (made["workspace"] / "link").symlink_to(made["elsewhere"])
    (made["workspace"] / "to-scratch").symlink_to(made["scratch"])
    return made


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("downloads", "workspace/downloads", id="relative"),
        pytest.param(".", "workspace", id="the-workspace-itself"),
        pytest.param("{scratch}/dl", "scratch/dl", id="absolute-in-an-allowed-folder"),
        pytest.param("to-scratch/dl", "scratch/dl", id="link-to-an-allowed-folder"),
        pytest.param("{workspace}/a/../b", "workspace/b", id="dot-dot-that-stays"),
    ],
)
def test_a_path_inside_one_of_the_folders_resolves(folders: dict[str, Path], value: str, expected: str) -> None:
    root = folders["workspace"].parent

    got = path_inside_any([folders["workspace"], folders["scratch"]], value.format(**folders), "d", "the folders")

    assert got == root / expected


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("../../escape", id="dot-dot"),
        pytest.param("{elsewhere}", id="absolute"),
        pytest.param("/etc", id="system-folder"),
        pytest.param("link/dl", id="link-out"),
        pytest.param("{scratch}-sibling", id="a-name-that-only-starts-like-one"),
    ],
)
def test_a_path_outside_every_folder_is_refused_naming_setting_value_and_fix(
    folders: dict[str, Path], value: str
) -> None:
    value = value.format(**folders)

    with pytest.raises(PathOutsideError) as caught:
        path_inside_any([folders["workspace"], folders["scratch"]], value, "download_to_disk_dir", "the folders")

    message = str(caught.value)
    assert message.startswith(f"download_to_disk_dir: {value!r} leads to ")
    assert f"outside the folders ({folders['workspace']}, {folders['scratch']})" in message
    assert message.endswith(
        "; give a path inside one, or let the site allow a folder that holds it (flengine run --allow-dir DIR)"
    )
    assert caught.value.setting == "download_to_disk_dir"


def test_a_relative_path_starts_at_the_base_when_one_is_given(folders: dict[str, Path]) -> None:
    got = path_inside_any([folders["workspace"]], "x", "s", "w", base=folders["workspace"] / "sub")

    assert got == folders["workspace"] / "sub" / "x"


def job_paths(tmp_path: Path, allowed: tuple[Path, ...] = ()) -> JobPaths:
    job = tmp_path / "job"
    (job / "app" / "custom").mkdir(parents=True)
    return JobPaths(job / "app", job, tmp_path / "ws" / "server", allowed)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("custom/start.safetensors", "job/app/custom/start.safetensors", id="relative-to-the-app"),
        pytest.param("../shared/start.safetensors", "job/shared/start.safetensors", id="elsewhere-in-the-job"),
        pytest.param(
            "{tmp}/ws/server/models/global.safetensors", "ws/server/models/global.safetensors", id="workspace"
        ),
        pytest.param("{tmp}/ckpts/start.safetensors", "ckpts/start.safetensors", id="allowed"),
    ],
)
def test_a_job_path_may_lie_in_the_job_the_workspace_or_an_allowed_folder(
    tmp_path: Path, value: str, expected: str
) -> None:
    paths = job_paths(tmp_path, (tmp_path / "ckpts",))

    assert paths.resolve(value.format(tmp=tmp_path), "source_ckpt_file_full_name") == tmp_path / expected


@pytest.mark.parametrize("value", ["/etc/passwd", "../../x.safetensors"], ids=["absolute", "dot-dot"])
def test_a_job_path_outside_them_is_refused_naming_the_setting(tmp_path: Path, value: str) -> None:
    paths = job_paths(tmp_path)

    with pytest.raises(
        PathOutsideError,
        match=rf"^source_ckpt_file_full_name: '{value}' leads to .*, outside the job folder, the site's workspace and the folders the site allows .*--allow-dir",
    ):
        paths.resolve(value, "source_ckpt_file_full_name")
