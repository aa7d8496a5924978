"""`provision`: kits that real cells start from, and re-provisioning that never loses a key."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from engine.cells import Cell, Reply
from engine.errors import ProvisionError, SecurityError
from engine.provision import load_kit, load_project, load_site_policy, provision
from engine.provision.manifest import write_manifest
from engine.security import load_allowlist, load_cell_security, write_key_pair

from .conftest import WriteProject

WAIT_S = 10.0
SITE_3 = "  { name = site-2, org = org-b }\n  { name = site-3, org = org-c }"


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def key_files(kits: Path) -> dict[str, bytes]:
    return {k: v for k, v in files_of(kits).items() if "/keys/" in k}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_every_participant_gets_a_kit_with_private_keys(write_project: WriteProject, tmp_path: Path) -> None:
    report = provision(load_project(write_project()), tmp_path / "kits")

    kits = tmp_path / "kits"
    assert [(k.identity, k.kind, k.status) for k in report.kits] == [
        ("server", "server", "created"),
        ("site-1", "site", "created"),
        ("site-2", "site", "created"),
        ("alice", "admin", "created"),
    ]
    assert sorted(files_of(kits / "site-1")) == [
        "MANIFEST.json", "keys/server.key", "keys/site-1.key", "keys/site-1.key_secret", "kit.json", "policy.conf", "start.sh",
    ]  # fmt: skip
    assert sorted(files_of(kits / "server")) == [
        "MANIFEST.json", "keys/allowlist/alice.key", "keys/allowlist/site-1.key", "keys/allowlist/site-2.key",
        "keys/server.key", "keys/server.key_secret", "kit.json", "participants.json", "start.sh",
    ]  # fmt: skip
    for name in ("server", "site-1", "site-2", "alice"):
        assert stat.S_IMODE((kits / name / "keys" / f"{name}.key_secret").stat().st_mode) == 0o600
        assert stat.S_IMODE((kits / name / "keys").stat().st_mode) == 0o700
        assert stat.S_IMODE((kits / name).stat().st_mode) == 0o700
        assert os.access(kits / name / "start.sh", os.X_OK)
    assert stat.S_IMODE(kits.stat().st_mode) == 0o700


def test_a_kit_says_who_it_belongs_to_and_where_the_server_is(write_project: WriteProject, tmp_path: Path) -> None:
    provision(load_project(write_project()), tmp_path / "kits")

    server, site, admin = (load_kit(tmp_path / "kits" / name) for name in ("server", "site-1", "alice"))

    assert (server.participant.kind, server.cell_settings().host, server.cell_settings().port) == (
        "server",
        "127.0.0.1",
        8002,
    )
    assert (site.identity, site.participant.org, site.participant.resources) == ("site-1", "org-a", {"num_gpus": 1})
    assert site.server.connect_address == "tcp://127.0.0.1:8002"
    assert (admin.participant.kind, admin.participant.role) == ("admin", "project_admin")
    assert load_site_policy(tmp_path / "kits" / "site-1" / "policy.conf").refusal("alice", "coordinator", True) is None
    participants = (tmp_path / "kits" / "server" / "participants.json").read_text(encoding="utf-8")
    assert (
        '"site-1": {\n      "kind": "site",\n      "org": "org-a",\n      "resources": {\n        "num_gpus": 1'
        in participants
    )


def test_cells_started_from_the_kits_connect_and_talk(write_project: WriteProject, tmp_path: Path) -> None:
    provision(load_project(write_project(replace={"port = 8002": f"port = {free_port()}"})), tmp_path / "kits")
    server_kit, site_kit, admin_kit = (load_kit(tmp_path / "kits" / name) for name in ("server", "site-1", "alice"))
    # the kits' keys folders are what load_cell_security reads, unchanged
    assert load_cell_security(site_kit.keys_dir, "site-1", server=False).server_public_key == (
        server_kit.cell_security().public_key
    )

    server = Cell(server_kit.identity, server_kit.cell_settings(), security=server_kit.cell_security())
    site = Cell("site-1", connect_to=site_kit.server.connect_address, security=site_kit.cell_security())
    admin = Cell("alice", connect_to=admin_kit.server.connect_address, security=admin_kit.cell_security())
    server.register_handler("demo", "echo", lambda m: Reply(header={"source": m.source}))
    site.register_handler("demo", "echo", lambda m: Reply(frames=m.frames))
    try:
        server.start()
        site.start()
        admin.start()
        assert site.wait_connected(WAIT_S) and admin.wait_connected(WAIT_S)

        assert site.request("server", "demo", "echo", timeout_s=WAIT_S).header["source"] == "site-1"
        assert admin.request("server", "demo", "echo", timeout_s=WAIT_S).header["source"] == "alice"
        assert bytes(server.request("site-1", "demo", "echo", frames=[b"hi"], timeout_s=WAIT_S).frames[0]) == b"hi"
    finally:
        for cell in (admin, site, server):
            cell.stop()


def test_provisioning_again_adds_a_site_and_keeps_every_key(write_project: WriteProject, tmp_path: Path) -> None:
    kits = tmp_path / "kits"
    provision(load_project(write_project()), kits)
    keys_before = key_files(kits)
    site_1_before = files_of(kits / "site-1")

    report = provision(load_project(write_project(replace={"  { name = site-2, org = org-b }": SITE_3})), kits)

    assert {k.identity: k.status for k in report.kits} == {
        "server": "updated", "site-1": "kept", "site-2": "kept", "site-3": "created", "alice": "kept",
    }  # fmt: skip
    assert report.kits[0].files == ("keys/allowlist/site-3.key", "participants.json", "MANIFEST.json")
    assert {k: v for k, v in key_files(kits).items() if k in keys_before} == keys_before  # byte for byte
    assert files_of(kits / "site-1") == site_1_before
    assert load_allowlist(kits / "server" / "keys" / "allowlist").identities() == [
        "alice",
        "site-1",
        "site-2",
        "site-3",
    ]
    assert '"site-3"' in (kits / "server" / "participants.json").read_text(encoding="utf-8")
    for name in ("server", "site-1", "site-3"):
        load_kit(kits / name)  # manifests agree with the files


def test_a_new_port_rewrites_every_kit_and_keeps_its_keys(write_project: WriteProject, tmp_path: Path) -> None:
    kits = tmp_path / "kits"
    provision(load_project(write_project()), kits)
    keys_before = key_files(kits)

    report = provision(load_project(write_project(replace={"port = 8002": "port = 9100"})), kits)

    assert {k.status for k in report.kits} == {"updated"}
    assert report.kits[1].files == ("kit.json", "MANIFEST.json")
    assert key_files(kits) == keys_before
    assert load_kit(kits / "site-2").server.connect_address == "tcp://127.0.0.1:9100"
    assert load_kit(kits / "server").cell_settings().port == 9100


def test_a_site_edited_policy_survives_provisioning(write_project: WriteProject, tmp_path: Path) -> None:
    kits = tmp_path / "kits"
    provision(load_project(write_project()), kits)
    (kits / "site-1" / "policy.conf").write_text("allow_custom_code = false\n", encoding="utf-8")

    report = provision(load_project(write_project()), kits)

    assert report.kits[1].status == "kept"
    assert load_site_policy(kits / "site-1" / "policy.conf").refusal("alice", "coordinator", True) == (
        "this site runs no job that brings its own code (its policy's allow_custom_code = false)"
    )


def test_a_participant_left_out_is_revoked_only_with_remove(write_project: WriteProject, tmp_path: Path) -> None:
    kits = tmp_path / "kits"
    provision(load_project(write_project(replace={"  { name = site-2, org = org-b }": SITE_3})), kits)
    before = files_of(kits)
    smaller = load_project(
        write_project(replace={"  { name = site-2, org = org-b }": "  { name = site-2, org = org-b }"})
    )

    with pytest.raises(
        ProvisionError,
        match="'site-3' has a kit there but the project file no longer names it; run again with --remove",
    ):
        provision(smaller, kits)
    assert files_of(kits) == before  # nothing written

    report = provision(smaller, kits, remove=True)

    assert [(k.identity, k.status) for k in report.kits if k.status != "kept"] == [
        ("server", "updated"),
        ("site-3", "removed"),
    ]
    assert report.kits[-1].kind == "site"
    assert not (kits / "site-3").exists()
    assert load_allowlist(kits / "server" / "keys" / "allowlist").identities() == ["alice", "site-1", "site-2"]
    load_kit(kits / "server")


def swap_site_keys(kits: Path) -> str:
    """Give site-1's kit a key pair of its own that the server never saw."""
    for suffix in (".key", ".key_secret"):
        (kits / "site-1" / "keys" / f"site-1{suffix}").unlink()
    write_key_pair(kits / "site-1" / "keys", "site-1")
    write_manifest(kits / "site-1")  # consistent in itself: only the allowlist can tell
    return r"site-1.key_secret: does not match the key of 'site-1' on the server's allowlist"


def delete_site_kit(kits: Path) -> str:
    shutil.rmtree(kits / "site-2")
    return r"site-2: missing, but the server's allowlist holds the key of 'site-2'; restore the kit folder"


def edit_kit_file(kits: Path) -> str:
    (kits / "alice" / "kit.json").write_text((kits / "alice" / "kit.json").read_text().replace("coordinator", "x"))
    return r"alice/kit.json: changed since the kit was provisioned"


def delete_server_kit(kits: Path) -> str:
    shutil.rmtree(kits / "server")
    return r"holds kits but no server kit; restore .*server \(the kits there trust its key\)"


@pytest.mark.parametrize(
    "damage",
    [swap_site_keys, delete_site_kit, edit_kit_file, delete_server_kit],
    ids=["keys-do-not-match-allowlist", "kit-missing", "kit-edited-by-hand", "server-kit-missing"],
)
def test_a_folder_at_odds_with_itself_stops_provisioning_before_any_write(
    write_project: WriteProject, tmp_path: Path, damage
) -> None:
    kits = tmp_path / "kits"
    provision(load_project(write_project()), kits)
    match = damage(kits)
    before = files_of(kits)

    with pytest.raises((ProvisionError, SecurityError), match=match):
        provision(load_project(write_project(replace={"  { name = site-2, org = org-b }": SITE_3})), kits)

    assert files_of(kits) == before


def test_a_participant_cannot_change_kind(write_project: WriteProject, tmp_path: Path) -> None:
    kits = tmp_path / "kits"
    provision(load_project(write_project()), kits)
    changed = write_project(
        replace={
            "  { name = site-2, org = org-b }\n": "",
            "admins = [\n": "admins = [\n  { name = site-2, org = org-b, role = lead }\n",
        }
    )

    with pytest.raises(ProvisionError, match="'site-2' was provisioned as a site and is an admin in the project file"):
        provision(load_project(changed), kits)


def test_start_sh_runs_the_flengine_command_on_its_own_kit(write_project: WriteProject, tmp_path: Path) -> None:
    kits = tmp_path / "kit folder"  # a space in the path
    provision(load_project(write_project()), kits)
    fake = tmp_path / "fake-flengine"
    fake.write_text('#!/bin/sh\nfor arg in "$@"; do echo "[$arg]"; done\n', encoding="utf-8")
    fake.chmod(0o755)
    environment = {**os.environ, "FLENGINE": str(fake)}

    def run(kit: str, *args: str) -> list[str]:
        done = subprocess.run(
            ["sh", f"{kits.name}/{kit}/start.sh", *args],
            cwd=tmp_path,
            env=environment,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return done.stdout.splitlines()

    real = kits.resolve()
    assert run("server", "--workspace", "w s") == ["[server]", "[start]", f"[{real}/server]", "[--workspace]", "[w s]"]
    assert run("site-1") == ["[client]", "[start]", f"[{real}/site-1]"]
    assert run("alice", "list", "--format", "json") == ["[admin]", f"[{real}/alice]", "[list]", "[--format]", "[json]"]
