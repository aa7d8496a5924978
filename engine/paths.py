"""Paths that come from a job or a config stay inside the folder they belong to.

A job folder is hostile until checked: ``task_script_path = "../../../etc/passwd"``, an absolute
path, or a symlink inside ``custom/`` that points elsewhere must not make a site read or write
outside the folder the setting is about. :func:`path_inside` resolves a path (symlinks included)
and refuses it, naming the setting, when it leaves its folder.
"""

from __future__ import annotations

import os
from pathlib import Path


class PathOutsideError(ValueError):
    """A path from a job or config leaves the folder it must stay in (the message names the setting)."""


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
    if target != base and not target.is_relative_to(base):
        raise PathOutsideError(
            f"{setting}: {os.fspath(value)!r} leads to {target}, outside {what} {base}; give a path inside {what}"
        )
    return target
