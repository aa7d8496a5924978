"""``flengine provision``: one line per kit, --format json, every problem of a bad project file, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main

from .conftest import WriteProject

REPO = Path(__file__).resolve().parents[3]


def test_provision_end_to_end_through_python_m_engine(write_project: WriteProject, tmp_path: Path) -> None:
    write_project()

    done = subprocess.run(
        [sys.executable, "-m", "engine", "provision", "project.conf", "-o", "kits"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "status   name    kind    folder",
        "created  server  server  kits/server",
        "created  site-1  site    kits/site-1",
        "created  site-2  site    kits/site-2",
        "created  alice   admin   kits/alice",
        "project demo: 4 created; send each created or updated kit to its owner, privately (it holds the owner's secret key)",
    ]
    assert (tmp_path / "kits" / "site-2" / "keys" / "site-2.key_secret").is_file()


def test_provision_again_says_what_changed(write_project: WriteProject, capsys: pytest.CaptureFixture[str]) -> None:
    main(["provision", str(write_project()), "-o", "kits"])
    capsys.readouterr()
    bigger = write_project(
        replace={
            "  { name = site-2, org = org-b }": "  { name = site-2, org = org-b }\n  { name = site-3, org = org-c }"
        }
    )

    code = main(["provision", str(bigger), "-o", "kits", "--format", "json"])

    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(k["identity"], k["status"]) for k in report["kits"]] == [
        ("server", "updated"), ("site-1", "kept"), ("site-2", "kept"), ("site-3", "created"), ("alice", "kept"),
    ]  # fmt: skip
    assert report["kits"][0] == {
        "identity": "server",
        "kind": "server",
        "status": "updated",
        "folder": "kits/server",
        "files": ["keys/allowlist/site-3.key", "participants.json", "MANIFEST.json"],
    }

    main(["provision", str(bigger), "-o", "kits"])
    assert capsys.readouterr().out.splitlines()[-1] == "project demo: 5 kept; nothing to send"


def test_a_bad_project_file_lists_every_problem_and_writes_nothing(
    write_project: WriteProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_project(replace={"name = site-2,": "name = site.2,", "role = project_admin": "role = owner"})

    code = main(["provision", str(path), "-o", "kits"])

    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "Error: project.conf: 2 problems; nothing was written",
        'project.conf:5: sites[1].name: "site.2" is not a valid name (letters, digits, "_" and "-", starting with a letter or digit, and no dots: a name is a cell name, e.g. site-1)',
        'project.conf:8: admins[0].role: must be one of "project_admin", "org_admin", "lead", "member", got "owner"',
    ]
    assert not (tmp_path / "kits").exists()


def test_a_removed_participant_needs_remove(write_project: WriteProject, capsys: pytest.CaptureFixture[str]) -> None:
    main(["provision", str(write_project()), "-o", "kits"])
    smaller = write_project(replace={"  { name = site-2, org = org-b }\n": ""})
    capsys.readouterr()

    code = main(["provision", str(smaller), "-o", "kits"])

    assert code == 1
    assert capsys.readouterr().err.startswith(
        "Error: kits: 'site-2' has a kit there but the project file no longer names it"
    )

    assert main(["provision", str(smaller), "-o", "kits", "--remove"]) == 0
    assert "removed  site-2  site    key revoked, kit deleted" in capsys.readouterr().out


def test_validate_checks_a_project_file(write_project: WriteProject, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_project()
    bad = write_project(replace={"role = project_admin": "role = lead"}, name="bad.conf")

    code = main(["validate", str(good), str(bad)])

    assert code == 1
    assert capsys.readouterr().out.splitlines() == [
        "project.conf: ok",
        'bad.conf:7: admins: no admin has role "project_admin" (give one admin `role = project_admin`: the project\'s owner, who may do everything)',
        "bad.conf: 1 problem",
        "2 jobs checked, 1 invalid",
    ]
