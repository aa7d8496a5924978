"""Whether a job brings its own code, found by reading its files only: nothing is imported.

A job runs only flengine's code when every dotted path it builds names one of flengine's own
components (`engine.config.build.is_engine_component`) and no app has files in ``custom/``.
Anything else is code the job brings, which a server runs only for an admin with the ``byoc``
right (`engine.deploy.authz`) and a site only when its policy allows custom code.

Example::

    job = load_job(folder, build=False, environment=False)
    reasons = job_code_of(job)
    if reasons:
        refusal = authorize(user, "byoc")
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.config.build import ComponentSpec, component_paths, is_engine_component
from engine.config.job import Job, component_entries
from engine.config.problems import format_key_path
from engine.config.source import ConfigDocument


def job_code_of(job: Job) -> list[str]:
    """List the reasons a job brings its own code, without importing anything of it.

    Args:
        job: A job read with `load_job` (``build=False`` is enough).

    Returns:
        One entry per app whose ``custom/`` folder holds files, e.g. ``app/custom/ (3 files)``,
        then one per dotted path that is not one of flengine's components, e.g.
        ``app/config/config_fed_server.conf:12: workflows[0].path = os.system``. Files are named
        relative to the job folder. Empty when the job runs flengine's code only.
    """
    reasons = []
    for app in job.apps.values():
        files = _count_files(app.custom_dir)
        if files:
            custom = _relative(app.folder / "custom", job.folder)
            reasons.append(f"{custom}/ ({files} file{'s' if files != 1 else ''})")
        for document in (app.server, app.client):
            if document is not None:
                reasons += _foreign_paths(document, job.folder)
    return reasons


def _foreign_paths(document: ConfigDocument, job_folder: Path) -> list[str]:
    """One reason per dotted path of ``document`` that `build_component` would build and is not flengine's."""
    file = _relative(document.path, job_folder)
    reasons = []
    for key_path, entry in component_entries(document.data):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            continue  # not a component the runtime builds
        args = entry.get("args")
        spec = ComponentSpec(entry["path"], args if isinstance(args, dict) else {}, key_path=key_path)
        for path_key, path in component_paths(spec):
            if not is_engine_component(path):
                line = document.line_of(path_key)
                where = f"{file}:{line}" if line is not None else file
                reasons.append(f"{where}: {format_key_path(path_key)} = {path}")
    return reasons


def _count_files(folder: Path | None) -> int:
    """Files in ``folder`` and below; a symbolic link or a folder that cannot be read counts as one."""
    if folder is None or not folder.is_dir():
        return 0
    unreadable: list[OSError] = []
    count = 0
    for root, dirs, files in os.walk(folder, onerror=unreadable.append):
        count += len(files) + sum(1 for name in dirs if os.path.islink(os.path.join(root, name)))
    return count + len(unreadable)


def _relative(path: Path, folder: Path) -> str:
    try:
        return path.relative_to(folder).as_posix()
    except ValueError:
        return path.as_posix()
