"""Paths that come from a job or a config stay inside the folders they belong to.

A job folder is hostile until checked: ``task_script_path = "../../../etc/passwd"``, an absolute
path, or a symlink inside ``custom/`` that points elsewhere must not make a site read or write
outside the folder the setting is about. :func:`path_inside` resolves a path (symlinks included)
and refuses it, naming the setting, when it leaves its folder; :func:`path_inside_any` does the
same for a path that may lie in any of several folders, and :class:`JobPaths` holds the folders a
running job's paths may name on a site: its job folder, the site's workspace, and the folders the
site allows (a site decides those, never a job).

Where the folder is not known yet (a component's constructor), :func:`plain_file_name` and
:func:`relative_path` refuse what can only lead out (``..``, an absolute path) from the text
alone, so the mistake is reported where the config is built; :func:`no_link_out` then catches,
once the folder is known, a symbolic link that leads a path the site builds itself out of it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path, PurePath

from engine.errors import PathOutsideError

#: How a site lets a job name a folder outside the job and the workspace (for messages).
ALLOW_DIR_HINT = "let the site allow a folder that holds it (flengine run --allow-dir DIR)"


def path_inside(folder: Path, value: str | os.PathLike[str], setting: str, what: str = "folder") -> Path:
    """Return ``folder / value`` resolved, or raise `PathOutsideError` if it leaves ``folder``.

    Args:
        folder: The folder the path must stay in (it need not exist yet).
        value: The path as the config gives it, relative to ``folder`` (an absolute path is
            accepted only when it lies inside ``folder``).
        setting: The setting's name, for the message (``task_script_path``).
        what: How to call ``folder`` in the message (``the app's custom/ folder``).

    Example:
        >>> path_inside(Path("/job/custom"), "train.py", "task_script_path")
        PosixPath('/job/custom/train.py')
    """
    base = Path(folder).resolve()
    target = (base / Path(value)).resolve()
    if not _lies_in(target, base):
        raise PathOutsideError(
            setting, f"{os.fspath(value)!r} leads to {target}, outside {what} {base}; give a path inside {what}"
        )
    return target


def path_inside_any(
    folders: Sequence[Path],
    value: str | os.PathLike[str],
    setting: str,
    what: str,
    *,
    base: Path | None = None,
    fix: str = ALLOW_DIR_HINT,
) -> Path:
    """Return ``value`` resolved, or raise `PathOutsideError` if it lies in none of ``folders``.

    Args:
        folders: The folders the path may lie in (they need not exist yet); at least one.
        value: The path as the config gives it; a relative one starts at ``base``.
        setting: The setting's name, for the message (``download_to_disk_dir``).
        what: How to call the folders in the message (``the workspace and the folders the site allows``).
        base: Where a relative path starts; the first of ``folders`` by default.
        fix: What else the user can do besides giving a path inside one of ``folders``.

    Example:
        >>> folders = [Path("/ws/server"), Path("/scratch")]
        >>> path_inside_any(folders, "/scratch/dl", "download_to_disk_dir", "the workspace and the allowed folders")
        PosixPath('/scratch/dl')
    """
    if not folders:
        raise ValueError(f"{setting}: no folder to check {os.fspath(value)!r} against")
    roots = [Path(folder).resolve() for folder in folders]
    start = roots[0] if base is None else Path(base).resolve()
    target = (start / Path(value)).resolve()
    if any(_lies_in(target, root) for root in roots):
        return target
    listed = ", ".join(str(root) for root in roots)
    detail = f"{os.fspath(value)!r} leads to {target}, outside {what} ({listed}); give a path inside one, or {fix}"
    raise PathOutsideError(setting, detail)


def plain_file_name(value: str, setting: str, what: str) -> str:
    """Return ``value`` if it is a plain file name, or raise `PathOutsideError` naming ``setting``.

    A file name arg (``global_model_file_name``) names a file in a folder the site chooses; a
    folder in it, ``..`` or an absolute path could only lead somewhere else.

    Args:
        value: The name as the config gives it.
        setting: The setting's name, for the message.
        what: The folder the file goes in, for the message (``the models folder``).

    Raises:
        ValueError: ``value`` is empty or not a string.
        PathOutsideError: ``value`` is absolute, ``.`` or ``..``, or has a folder in it.

    Example:
        >>> plain_file_name("global.safetensors", "global_model_file_name", "the models folder")
        'global.safetensors'
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{setting}: expected a plain file name (it goes in {what}), got {value!r}")
    if value in (".", "..") or PurePath(value).name != value:
        raise PathOutsideError(
            setting,
            f"expected a plain file name (it goes in {what}), got {value!r}; "
            "give the file name alone (no folder, no '..')",
        )
    return value


def relative_path(value: str | os.PathLike[str], setting: str, what: str) -> PurePath:
    """Return ``value`` if, relative to a folder not known yet, it stays in it; else `PathOutsideError`.

    Only the text is checked (an absolute path, or one that climbs out with ``..``); a symbolic
    link that leads out is caught by `path_inside` once the folder is known.

    Args:
        value: The path as the config gives it.
        setting: The setting's name, for the message (``result_file``).
        what: How to call the folder in the message (``the server's workspace folder``).

    Raises:
        ValueError: ``value`` is empty.
        PathOutsideError: ``value`` is absolute or climbs out with ``..``.

    Example:
        >>> relative_path("results/cse.json", "result_file", "the server's workspace folder")
        PurePosixPath('results/cse.json')
    """
    if not os.fspath(value):
        raise ValueError(f"{setting}: expected a path relative to {what}, got ''")
    path = PurePath(value)
    if path.is_absolute() or path.anchor:
        raise PathOutsideError(setting, f"{os.fspath(value)!r} is absolute; give a path relative to {what}")
    if os.path.normpath(path).split(os.sep)[0] == os.pardir:
        raise PathOutsideError(
            setting, f"{os.fspath(value)!r} climbs out of {what} with '..'; give a path inside {what}"
        )
    return path


def no_link_out(path: Path, folder: Path, setting: str, what: str) -> Path:
    """Return ``path`` resolved, or raise `PathOutsideError` if a symbolic link leads it out of ``folder``.

    For a path a site builds itself inside ``folder`` (a fixed folder and a checked file name):
    only a link on the way can lead it out.

    Args:
        path: The path, inside ``folder`` as written.
        folder: The folder it must stay in, links resolved.
        setting: The setting the path comes from, for the message (``global_model_file_name``).
        what: How to call ``folder`` in the message (``the site's workspace``).
    """
    base = Path(folder).resolve()
    target = Path(path).resolve()
    if not _lies_in(target, base):
        raise PathOutsideError(
            setting,
            f"{path} leads to {target} through a symbolic link, outside {what} {base}; "
            "remove the link or make it point inside",
        )
    return target


@dataclasses.dataclass(frozen=True)
class JobPaths:
    """The folders a running job's paths may name on a site (given to components at job start).

    A path from the job's config may lie in the job folder, the site's workspace folder for the
    job, or one of the folders the site allows; a relative one starts at the app folder.

    Attributes:
        app_dir: The job's app folder on this site (where relative paths start).
        job_dir: The job folder.
        workspace: This site's folder of the job's workspace (``<workspace>/server``).
        allowed_dirs: The folders outside those that the site lets jobs name (its ``allowed_dirs``).

    Example:
        >>> paths = JobPaths(Path("/jobs/j/app"), Path("/jobs/j"), Path("/ws/server"))
        >>> paths.resolve("custom/start.safetensors", "source_ckpt_file_full_name")
        PosixPath('/jobs/j/app/custom/start.safetensors')
    """

    app_dir: Path
    job_dir: Path
    workspace: Path
    allowed_dirs: tuple[Path, ...] = ()

    @property
    def custom_dir(self) -> Path:
        """The app's ``custom/`` folder: the job's own code, where its scripts must stay."""
        return self.app_dir / "custom"

    def resolve(self, value: str | os.PathLike[str], setting: str) -> Path:
        """``value`` resolved (symlinks included), or `PathOutsideError` naming ``setting``.

        For a path the job reads: it may lie in the job folder, the workspace or an allowed folder;
        a relative one starts at the app folder.
        """
        return path_inside_any(
            [self.job_dir, self.workspace, *self.allowed_dirs],
            value,
            setting,
            "the job folder, the site's workspace and the folders the site allows",
            base=self.app_dir,
        )

    def resolve_output(self, value: str | os.PathLike[str], setting: str) -> Path:
        """``value`` resolved (symlinks included), or `PathOutsideError` naming ``setting``.

        For a path the job writes to (``download_to_disk_dir``): it may lie in the site's
        workspace or an allowed folder, never in the job folder; a relative one starts at the
        workspace.

        Example:
            >>> paths = JobPaths(Path("/jobs/j/app"), Path("/jobs/j"), Path("/ws/site-1"))
            >>> paths.resolve_output("dl", "download_to_disk_dir")
            PosixPath('/ws/site-1/dl')
        """
        return path_inside_any(
            [self.workspace, *self.allowed_dirs],
            value,
            setting,
            "the site's workspace and the folders the site allows",
        )


def _lies_in(target: Path, folder: Path) -> bool:
    return target == folder or target.is_relative_to(folder)
