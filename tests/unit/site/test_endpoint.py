"""A site's settings and the endpoints built from them: keys required unless insecure, script credentials."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cells import CellSettings
from engine.errors import SecurityError
from engine.security import write_site_key_folders
from engine.site import ScriptCredentials, SiteEndpoint, SiteSettings, cell_settings_of, insecure_requested


def test_a_site_without_keys_must_say_insecure() -> None:
    with pytest.raises(SecurityError, match="site 'site-1': no keys folder; .* or set insecure = true"):
        SiteSettings("site-1")

    assert SiteSettings("site-1", insecure=True).cell_security(server=False) is None


def test_a_site_loads_the_keys_of_its_role(tmp_path: Path) -> None:
    folders = write_site_key_folders(tmp_path, "server", ["site-1"])

    server = SiteSettings("server", keys_dir=folders["server"]).cell_security(server=True)
    client = SiteSettings("site-1", keys_dir=folders["site-1"]).cell_security(server=False)

    assert server is not None and client is not None
    assert client.server_public_key == server.public_key


def test_a_refusal_names_the_files_to_check(tmp_path: Path) -> None:
    site = SiteSettings("site-1", keys_dir=tmp_path)

    message = site.describe_refusal("the server refused this cell's key")

    assert f"check that {tmp_path / 'server.key'} is the server's public key" in message
    assert f"the server's allowlist holds {tmp_path / 'site-1.key'}" in message


def test_the_cell_object_of_a_config_splits_into_cell_settings_and_the_insecure_switch() -> None:
    config = {"cell": {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 2.0, "insecure": True}}

    assert cell_settings_of(config) == CellSettings(heartbeat_interval_s=1.0, heartbeat_timeout_s=2.0)
    assert insecure_requested(config) is True
    assert insecure_requested({"cell": {}}) is False


def test_script_credentials_travel_in_the_environment_and_match_the_host() -> None:
    host, credentials = SiteEndpoint.for_script_host("site-1", {}, secure=True)
    assert credentials is not None

    back = ScriptCredentials.from_environment(credentials.to_environment())

    assert back == credentials
    security = host.cell._security  # noqa: SLF001 - the host's allowlist holds exactly the script's key
    assert security is not None and security.allowlist is not None
    assert security.allowlist.identities() == ["site-1.script"]
    assert back.cell_security().server_public_key == security.public_key
    assert ScriptCredentials.from_environment({}) is None
    with pytest.raises(SecurityError, match="has only part of its keys in its environment"):
        ScriptCredentials.from_environment({"FLENGINE_SCRIPT_PUBLIC_KEY": "x"})


def test_an_insecure_script_host_has_no_credentials() -> None:
    host, credentials = SiteEndpoint.for_script_host("site-1", {}, secure=False)

    assert credentials is None and not host.cell.secure
