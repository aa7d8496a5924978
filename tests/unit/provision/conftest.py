"""A small project file, written per test, that a test edits into the case it needs."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

BASE_PROJECT = """\
name = demo
server { host = 127.0.0.1, port = 8002, org = coordinator }
sites = [
  { name = site-1, org = org-a, resources { num_gpus = 1 } }
  { name = site-2, org = org-b }
]
admins = [
  { name = alice, org = coordinator, role = project_admin }
]
"""

WriteProject = Callable[..., Path]


@pytest.fixture
def write_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WriteProject:
    """Write ``project.conf`` in a temp folder that is also the cwd; messages name it ``project.conf``.

    ``write_project(replace={"old": "new"})`` edits the base text; ``write_project(text=...)``
    writes other text; ``name`` picks another file name (``project.json`` for JSON).
    """
    monkeypatch.chdir(tmp_path)

    def write(text: str = BASE_PROJECT, replace: dict[str, str] | None = None, name: str = "project.conf") -> Path:
        for old, new in (replace or {}).items():
            assert old in text, f"{old!r} is not in the project text"
            text = text.replace(old, new)
        (tmp_path / name).write_text(textwrap.dedent(text), encoding="utf-8")
        return Path(name)

    return write
