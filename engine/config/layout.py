"""Where things are in a job folder: ``meta``, app folders, and each app's config files.

```
jobs/fedavg/
  meta.conf                               # or meta.json
  app/config/config_fed_server.conf       # or .json
  app/config/config_fed_client.conf       # or .json
  app/custom/                             # optional: the job's own code
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.config.problems import Problem
from engine.config.source import CONFIG_SUFFIXES

META_STEM = "meta"
SERVER_CONFIG_STEM = "config_fed_server"
CLIENT_CONFIG_STEM = "config_fed_client"
_LAYOUT_HINT = (
    "a job needs meta.conf and an app folder with config/config_fed_server.conf and config/config_fed_client.conf"
)


@dataclass
class AppLayout:
    """The files of one app folder.

    Attributes:
        name: The folder's name, as used in ``deploy_map``.
        folder: The app folder.
        server_config: ``config/config_fed_server.{conf,json}``, if present.
        client_config: ``config/config_fed_client.{conf,json}``, if present.
        custom_dir: ``custom/``, the job's own code, if present.
    """

    name: str
    folder: Path
    server_config: Path | None = None
    client_config: Path | None = None
    custom_dir: Path | None = None


@dataclass
class JobLayout:
    """The files of a job folder, as found on disk.

    Attributes:
        folder: The job folder.
        display: The folder as the user named it; file names in messages start with it.
        meta_file: ``meta.conf`` or ``meta.json``, if present.
        apps: App folders (those with a ``config/`` folder) by name.
    """

    folder: Path
    display: str
    meta_file: Path | None = None
    apps: dict[str, AppLayout] = field(default_factory=dict)

    def display_of(self, path: Path) -> str:
        """Name ``path`` (inside the job folder) the way messages show it."""
        return os.path.join(self.display, os.path.relpath(path, self.folder))


def discover_layout(folder: Path, display: str) -> tuple[JobLayout, list[Problem]]:
    """Find the meta file and app folders of a job; return them with any layout problems."""
    layout = JobLayout(folder, display)
    if not folder.exists():
        return layout, [Problem(display, None, (), "no such job folder")]
    if not folder.is_dir():
        return layout, [Problem(display, None, (), "not a folder", "give the path of a job folder")]
    if not any(folder.iterdir()):
        return layout, [Problem(display, None, (), "the job folder is empty", _LAYOUT_HINT)]

    layout.meta_file, problems = find_config(folder, META_STEM, layout)
    if layout.meta_file is None:
        problems.append(Problem(display, None, (), "no meta.conf or meta.json", _LAYOUT_HINT))
    for child in sorted(folder.iterdir()):
        if child.is_dir() and (child / "config").is_dir():
            app, app_problems = _discover_app(child, layout)
            layout.apps[app.name] = app
            problems.extend(app_problems)
    return layout, problems


def find_config(folder: Path, stem: str, layout: JobLayout) -> tuple[Path | None, list[Problem]]:
    """Find ``stem.conf`` or ``stem.json`` in ``folder``.

    Having both is a problem; the ``.conf`` is still returned so the rest of it gets checked.
    """
    found = [folder / f"{stem}{suffix}" for suffix in CONFIG_SUFFIXES if (folder / f"{stem}{suffix}").is_file()]
    problems = []
    if len(found) > 1:
        names = " and ".join(p.name for p in found)
        problems.append(Problem(layout.display_of(folder), None, (), f"both {names} exist", "keep one of them"))
    return (found[0] if found else None), problems


def _discover_app(folder: Path, layout: JobLayout) -> tuple[AppLayout, list[Problem]]:
    config_dir = folder / "config"
    server_config, problems = find_config(config_dir, SERVER_CONFIG_STEM, layout)
    client_config, client_problems = find_config(config_dir, CLIENT_CONFIG_STEM, layout)
    problems += client_problems
    custom = folder / "custom"
    app = AppLayout(folder.name, folder, server_config, client_config, custom if custom.is_dir() else None)
    if server_config is None and client_config is None:
        hint = "add config_fed_server.conf and/or config_fed_client.conf"
        problems.append(
            Problem(layout.display_of(config_dir), None, (), "no config file in the app's config folder", hint)
        )
    return app, problems
