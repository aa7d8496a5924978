"""A small valid job folder, written per test, that a test edits into the case it needs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from .config.sample_job import BASE_FILES, MakeJob


@pytest.fixture
def make_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MakeJob:
    """Write the base job as ``./job`` (cwd is a temp folder) with some files replaced or removed.

    ``make_job({"meta.conf": None, "meta.json": "..."})`` removes meta.conf and adds meta.json.
    Messages then name files as ``job/...``, as they would for ``flengine validate job``.
    """
    monkeypatch.chdir(tmp_path)

    def make(changes: dict[str, str | None] | None = None, name: str = "job") -> Path:
        files = {**BASE_FILES, **(changes or {})}
        for relative, text in files.items():
            if text is None:
                continue
            path = tmp_path / name / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text), encoding="utf-8")
        return Path(name)

    return make
