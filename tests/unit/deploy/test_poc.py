"""`flengine poc prepare` and the POC commands that need no daemon: the folder, the project file,
its re-runs, the port check and the refusals, each naming the folder and the fix."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

import pytest

from engine.cli import main
from engine.deploy.pidfile import ProcessRecord, write_pid_file
from engine.deploy.poc import PocError, prepare, project_text, status, stop, taken_ports
from engine.errors import ConfigError, UsageError


@pytest.fixture
def port() -> int:
    """A port p such that p .. p + 10 are free on 127.0.0.1 now."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        if not taken_ports("127.0.0.1", base, 11):
            return base
    raise RuntimeError("no free block of ports")


def test_prepare_writes_the_project_file_and_a_kit_per_participant(tmp_path: Path, port: int) -> None:
    folder = tmp_path / "poc"

    report = prepare(folder, port=port)

    assert report.project_status == "created"
    assert (folder / "project.conf").read_text() == project_text(2, port)
    assert [(kit.identity, kit.kind, kit.status) for kit in report.provisioned.kits] == [
        ("server", "server", "created"),
        ("site-1", "site", "created"),
        ("site-2", "site", "created"),
        ("admin", "admin", "created"),
    ]
    assert report.ports == (port, port + 10)
    assert json.loads((folder / "kits" / "server" / "kit.json").read_text())["server"]["host"] == "127.0.0.1"
    assert (folder / "run").is_dir()


def test_prepare_again_with_more_sites_keeps_every_key(tmp_path: Path, port: int) -> None:
    folder = tmp_path / "poc"
    prepare(folder, port=port)
    secret = (folder / "kits" / "site-1" / "keys" / "site-1.key_secret").read_bytes()

    report = prepare(folder, sites=3)

    assert report.project_status == "updated"
    assert (folder / "project.conf").read_text() == project_text(3, port)
    assert {kit.identity: kit.status for kit in report.provisioned.kits} == {
        "server": "updated",
        "site-1": "kept",
        "site-2": "kept",
        "site-3": "created",
        "admin": "kept",
    }
    assert (folder / "kits" / "site-1" / "keys" / "site-1.key_secret").read_bytes() == secret


def test_prepare_again_uses_an_edited_project_file_as_it_is(tmp_path: Path, port: int) -> None:
    folder = tmp_path / "poc"
    prepare(folder, port=port)
    project = folder / "project.conf"
    project.write_text(project.read_text().replace("{ name = site-2, org = poc }", "{ name = lab, org = lab-org }"))

    report = prepare(folder)

    assert report.project_status == "kept"
    assert {kit.identity: kit.status for kit in report.provisioned.kits}["lab"] == "created"
    assert {kit.identity: kit.status for kit in report.provisioned.kits}["site-2"] == "removed"
    with pytest.raises(UsageError, match=r"project\.conf: edited since `flengine poc prepare` wrote it, so -n and"):
        prepare(folder, sites=4)


@pytest.mark.parametrize(
    ("sites", "port_number", "message"),
    [
        (0, None, "-n 0: a POC needs at least one site"),
        (None, 80, r"--port 80: give a port in 1024\.\.65525 \(it takes the next 10 too\)"),
    ],
    ids=["no-sites", "low-port"],
)
def test_prepare_refuses_bad_numbers(tmp_path: Path, sites: int | None, port_number: int | None, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        prepare(tmp_path / "poc", sites=sites, port=port_number)

    assert not (tmp_path / "poc").exists()


def test_prepare_names_the_ports_in_use_and_writes_nothing(tmp_path: Path, port: int) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + 3))
        holder.listen()

        with pytest.raises(PocError) as caught:
            prepare(tmp_path / "poc", port=port)

    assert str(caught.value).startswith(
        f"port {port + 3} of {port}..{port + 10} on 127.0.0.1 is in use; the server takes {port} and its jobs "
        f"{port + 1}..{port + 10}. Stop what uses it, or choose another block: flengine poc prepare -d "
        f"{tmp_path / 'poc'} --port {port + 1000}"
    )
    assert not (tmp_path / "poc").exists()


def test_prepare_refuses_a_folder_that_is_not_a_poc(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")

    with pytest.raises(PocError, match=r"not a POC folder \(it holds files but no project\.conf\); give -d a new"):
        prepare(tmp_path)


def test_prepare_refuses_a_running_poc(tmp_path: Path, port: int) -> None:
    folder = tmp_path / "poc"
    prepare(folder, port=port)
    # this test's own process stands in for a running server: it is alive and its start time matches
    write_pid_file(folder / "run" / "server.pid", ProcessRecord.of(os.getpid(), "server", "server", ["pytest"]))

    with pytest.raises(PocError, match=r"the POC runs \(server\); stop it first: flengine poc stop -d "):
        prepare(folder, sites=3)

    (folder / "run" / "server.pid").unlink()


def test_status_and_stop_of_a_prepared_poc_that_never_started(tmp_path: Path, port: int) -> None:
    folder = tmp_path / "poc"
    prepare(folder, port=port)

    report = status(folder)
    stopped = stop(folder)

    assert [(d.name, d.state, d.pid) for d in report.daemons] == [
        ("server", "stopped", None),
        ("site-1", "stopped", None),
        ("site-2", "stopped", None),
    ]
    assert report.server == f"tcp://127.0.0.1:{port}"
    assert not report.all_up
    assert stopped.daemons == ()


@pytest.mark.parametrize("action", ["start", "status"])
def test_a_command_on_a_folder_never_prepared_says_how_to_prepare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    folder = tmp_path / "nowhere"

    code = main(["poc", action, "-d", str(folder)])

    assert code == 1
    assert capsys.readouterr().err == (
        f"Error: {folder}: not a prepared POC (no such folder); run `flengine poc prepare -d {folder}` first\n"
    )


def test_prepare_prints_each_kit_and_how_to_start(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "poc"

    code = main(["poc", "prepare", "-d", str(folder), "-n", "1", "--port", str(port)])

    assert code == 0
    assert capsys.readouterr().out.splitlines() == [
        "status   name    kind    folder",
        f"created  server  server  {folder}/kits/server",
        f"created  site-1  site    {folder}/kits/site-1",
        f"created  admin   admin   {folder}/kits/admin",
        f"POC prepared in {folder}: project file {folder}/project.conf (created); the server will take ports "
        f"{port}..{port + 10} on 127.0.0.1",
        f"start it: flengine poc start -d {folder}",
    ]


def test_prepare_again_names_the_line_of_a_broken_project_file(tmp_path: Path, port: int) -> None:
    folder = tmp_path / "poc"
    prepare(folder, port=port)
    project = folder / "project.conf"
    project.write_text(project.read_text().replace(f"port = {port}", "port = eighty"))

    with pytest.raises(ConfigError, match=rf"{project}:6: server\.port: "):
        prepare(folder)


def test_status_prints_a_row_per_daemon_under_a_header(
    tmp_path: Path, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "poc"
    prepare(folder, sites=1, port=port)

    code = main(["poc", "status", "-d", str(folder)])

    assert code == 1
    assert capsys.readouterr().out.splitlines() == [
        "name    state         pid      detail",
        f"server  stopped       -        tcp://127.0.0.1:{port}",
        "site-1  stopped       -",
        f"the POC in {folder} is not running; start it: flengine poc start -d {folder}",
    ]
