"""Key files: written safe, loaded only when safe, and a site's keys folder as the simulator writes it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth

from engine.errors import SecurityError
from engine.security import (
    load_allowlist,
    load_cell_security,
    load_public_key,
    load_secret_key,
    write_key_pair,
    write_public_key,
    write_site_key_folders,
)


def test_a_key_pair_is_written_with_a_private_secret_file_and_reads_back(tmp_path: Path) -> None:
    public, secret = write_key_pair(tmp_path / "keys", "site-1")

    secret_file = tmp_path / "keys" / "site-1.key_secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert load_secret_key(secret_file) == (public, secret)
    assert load_public_key(tmp_path / "keys" / "site-1.key") == (public, "site-1")
    # The files are ZeroMQ certificates: pyzmq's own reader agrees.
    assert zmq.auth.load_certificate(secret_file) == (public, secret)


def test_keys_are_never_overwritten(tmp_path: Path) -> None:
    write_key_pair(tmp_path, "site-1")

    with pytest.raises(SecurityError, match="site-1.key_secret: a key file of this name exists already"):
        write_key_pair(tmp_path, "site-1")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_secret_key_others_may_read_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    write_key_pair(tmp_path, "site-1")
    secret_file = tmp_path / "site-1.key_secret"
    os.chmod(secret_file, mode)

    with pytest.raises(
        SecurityError, match=rf"may be read by others \(mode {mode:04o}\); run `chmod 600 .*site-1.key_secret`"
    ):
        load_secret_key(secret_file)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b'curve\n    public-key = "tooshort"\n', "expected a CURVE key of 40 Z85 characters"),
        (b"nothing here\n", "no public-key in this key file"),
        (b"\xff\xfe binary", "not a key file .not ASCII text."),
    ],
    ids=["short-key", "no-key", "binary"],
)
def test_a_malformed_public_key_file_is_named(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "server.key"
    path.write_bytes(content)

    with pytest.raises(SecurityError, match=match):
        load_public_key(path)


def test_a_missing_key_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match=r"nope.key: cannot read the key file"):
        load_public_key(tmp_path / "nope.key")


def test_an_allowlist_file_renamed_to_another_identity_is_refused(tmp_path: Path) -> None:
    public, _ = write_key_pair(tmp_path / "own", "site-1")
    (tmp_path / "allowlist").mkdir()
    write_public_key(tmp_path / "allowlist" / "site-2.key", "site-1", public)

    with pytest.raises(SecurityError, match="named for 'site-2' but its metadata says 'site-1'"):
        load_allowlist(tmp_path / "allowlist")


def test_an_empty_or_missing_allowlist_is_refused(tmp_path: Path) -> None:
    (tmp_path / "allowlist").mkdir()
    with pytest.raises(SecurityError, match="the allowlist is empty"):
        load_allowlist(tmp_path / "allowlist")
    with pytest.raises(SecurityError, match="no allowlist folder"):
        load_allowlist(tmp_path / "missing")


def test_an_allowlist_of_named_identities_reads_their_files_and_nothing_else(tmp_path: Path) -> None:
    folders = write_site_key_folders(tmp_path, "server", ["site-1", "site-2"])
    allowlist_dir = folders["server"] / "allowlist"
    (allowlist_dir / "junk.key").write_text("not a key\n", encoding="utf-8")  # would fail if it were read

    allowlist = load_allowlist(allowlist_dir, ["site-1"])
    security = load_cell_security(folders["server"], "server", server=True, allowlist=["site-2"])

    assert allowlist.identities() == ["site-1"]
    assert security.allowlist is not None and security.allowlist.identities() == ["site-2"]


def test_a_named_identity_without_its_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    folders = write_site_key_folders(tmp_path, "server", ["site-1"])
    allowlist_dir = folders["server"] / "allowlist"

    with pytest.raises(SecurityError, match=f"{allowlist_dir}/site-9.key: cannot read the key file"):
        load_allowlist(allowlist_dir, ["site-1", "site-9"])
    with pytest.raises(SecurityError, match="the allowlist is empty"):
        load_allowlist(allowlist_dir, [])


def test_site_key_folders_give_each_cell_what_it_needs(tmp_path: Path) -> None:
    folders = write_site_key_folders(tmp_path, "server", ["site-1", "site-2"])

    server = load_cell_security(folders["server"], "server", server=True)
    site = load_cell_security(folders["site-1"], "site-1", server=False)

    assert server.allowlist is not None and server.allowlist.identities() == ["site-1", "site-2"]
    assert site.server_public_key == server.public_key
    assert not (folders["site-1"] / "server.key_secret").exists()
    assert sorted(p.name for p in folders["site-2"].iterdir()) == ["server.key", "site-2.key", "site-2.key_secret"]


def test_a_secret_key_behind_a_symlink_is_refused(tmp_path: Path) -> None:
    write_key_pair(tmp_path / "real", "site-1")
    (tmp_path / "link.key_secret").symlink_to(tmp_path / "real" / "site-1.key_secret")

    with pytest.raises(SecurityError, match="link.key_secret: cannot read the secret key file"):
        load_secret_key(tmp_path / "link.key_secret")


def test_a_secret_file_whose_public_key_is_not_its_own_is_refused(tmp_path: Path) -> None:
    public, _ = write_key_pair(tmp_path, "site-1")
    other_public, _ = write_key_pair(tmp_path, "site-2")
    secret_file = tmp_path / "site-1.key_secret"
    os.chmod(secret_file, 0o600)
    secret_file.write_text(secret_file.read_text().replace(public.decode(), other_public.decode()))

    with pytest.raises(SecurityError, match="the public key in this file does not belong to its secret key"):
        load_secret_key(secret_file)


def test_a_malformed_key_is_never_echoed(tmp_path: Path) -> None:
    public, _ = zmq.curve_keypair()
    path = tmp_path / "site-1.key_secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    text = f'curve\n    public-key = "{public.decode()}"\n    secret-key = "SECRET-WITH-A-TYPO-0123456789abcdefghijk"\n'
    os.write(fd, text.encode())
    os.close(fd)

    with pytest.raises(SecurityError) as caught:
        load_secret_key(path)

    assert "SECRET-WITH-A-TYPO" not in str(caught.value)
