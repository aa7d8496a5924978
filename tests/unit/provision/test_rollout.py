"""``flengine provision --server-kit``: the commands that replace the deployed server kit, run for real."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from engine.cli import main
from engine.errors import UsageError
from engine.provision import load_kit
from engine.provision.rollout import rollout_commands

from .conftest import WriteProject

WITHOUT_SITE_2 = {"  { name = site-2, org = org-b }\n": ""}


@pytest.mark.parametrize(
    ("destination", "first", "expected"),
    [
        (
            "/srv/fl/server",
            False,
            [
                "rm -rf /srv/fl/server.new && cp -Rp kits/server /srv/fl/server.new",
                "mv /srv/fl/server /srv/fl/server.old && mv /srv/fl/server.new /srv/fl/server",
                "rm -rf /srv/fl/server.old",
            ],
        ),
        (
            "/srv/fl/server",
            True,
            [
                "rm -rf /srv/fl/server.new && cp -Rp kits/server /srv/fl/server.new",
                "mv /srv/fl/server.new /srv/fl/server",
            ],
        ),
        (
            "fl.example.org:/srv/my kits/server",
            False,
            [
                "ssh fl.example.org 'rm -rf '\"'\"'/srv/my kits/server.new'\"'\"''",
                "scp -rp kits/server 'fl.example.org:/srv/my kits/server.new'",
                "ssh fl.example.org 'mv '\"'\"'/srv/my kits/server'\"'\"' '\"'\"'/srv/my kits/server.old'\"'\"' && "
                "mv '\"'\"'/srv/my kits/server.new'\"'\"' '\"'\"'/srv/my kits/server'\"'\"' && "
                "rm -rf '\"'\"'/srv/my kits/server.old'\"'\"''",
            ],
        ),
        (
            "./deployed/server",
            True,
            [
                "rm -rf ./deployed/server.new && cp -Rp kits/server ./deployed/server.new",
                "mv ./deployed/server.new ./deployed/server",
            ],
        ),
    ],
    ids=["local-update", "local-first", "remote-quoted", "relative-with-dot"],
)
def test_the_commands_replace_the_kit_folder(destination: str, first: bool, expected: list[str]) -> None:
    assert rollout_commands(Path("kits/server"), destination, first=first) == expected


@pytest.mark.parametrize("destination", ["", "/srv/fl/", "kits/server/.", ".", "host:"], ids=str)
def test_a_destination_that_is_not_a_kit_folder_is_refused(destination: str) -> None:
    with pytest.raises(UsageError, match="name the folder the server runs its kit from"):
        rollout_commands(Path("kits/server"), destination, first=False)


def test_the_printed_commands_replace_the_deployed_kit_leaving_no_revoked_key(
    write_project: WriteProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["provision", str(write_project()), "-o", "kits", "--server-kit", "deployed/server"]) == 0
    first = capsys.readouterr().out.split("# roll the server kit out to deployed/server", 1)[1].splitlines()[1:]
    subprocess.run(["sh", "-c", "mkdir deployed && " + " && ".join(first)], cwd=tmp_path, check=True)

    code = main(["provision", str(write_project(replace=WITHOUT_SITE_2)), "-o", "kits", "--remove",
                 "--server-kit", "deployed/server", "--format", "json"])  # fmt: skip
    rollout = json.loads(capsys.readouterr().out)["rollout"]
    subprocess.run(["sh", "-c", " && ".join(rollout)], cwd=tmp_path, check=True)

    assert code == 0 and len(first) == 2 and len(rollout) == 3
    kit = load_kit(tmp_path / "deployed" / "server")
    assert kit.allowlist == ("alice", "site-1") and kit.ignored_files == ()
    assert sorted(p.name for p in tmp_path.joinpath("deployed").iterdir()) == ["server"]
    assert (tmp_path / "deployed" / "server" / "keys" / "server.key_secret").stat().st_mode & 0o777 == 0o600


def test_nothing_to_roll_out_when_the_server_kit_is_kept(
    write_project: WriteProject, capsys: pytest.CaptureFixture[str]
) -> None:
    project = str(write_project())
    main(["provision", project, "-o", "kits"])
    capsys.readouterr()

    assert main(["provision", project, "-o", "kits", "--server-kit", "/srv/fl/server"]) == 0

    assert capsys.readouterr().out.splitlines()[-1] == (
        "# the server kit did not change: nothing to roll out to /srv/fl/server"
    )


def test_a_bad_server_kit_destination_writes_nothing(
    write_project: WriteProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["provision", str(write_project()), "-o", "kits", "--server-kit", "/srv/fl/"])

    assert code == UsageError.exit_code
    assert capsys.readouterr().err == (
        "Error: --server-kit '/srv/fl/': name the folder the server runs its kit from, e.g. /srv/flengine/server\n"
    )
    assert not (tmp_path / "kits").exists()
