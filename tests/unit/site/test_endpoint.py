"""A site's settings and the endpoints built from them: keys required unless insecure, script credentials,
downloads to disk only where the site allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cells import CellSettings
from engine.errors import PathOutsideError, SecurityError
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


# ----------------------------------------------------------------------------- downloads to disk


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    folder = tmp_path / "ws" / "server"
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def make_endpoint():
    """Endpoints of an insecure server site with the given allowed folders, closed at the end."""
    made: list[SiteEndpoint] = []

    def make(workspace: Path, allowed: tuple[Path, ...] = ()) -> SiteEndpoint:
        site = SiteSettings("server", insecure=True, allowed_dirs=allowed)
        made.append(SiteEndpoint.for_site(site, {}, workspace=workspace))
        return made[-1]

    yield make
    for endpoint in made:
        endpoint.close()


@pytest.mark.parametrize(
    "folder",
    [
        pytest.param("../../escape", id="dot-dot"),
        pytest.param("{tmp}/elsewhere", id="absolute-outside"),
        pytest.param("link", id="link-in-the-workspace-pointing-out"),
    ],
)
def test_downloads_to_disk_outside_the_workspace_and_allowed_folders_are_refused(
    make_endpoint, workspace: Path, tmp_path: Path, folder: str
) -> None:
    (tmp_path / "elsewhere").mkdir()
    (workspace / "link").symlink_to(tmp_path / "elsewhere")
    folder = folder.format(tmp=tmp_path)
    endpoint = make_endpoint(workspace, (tmp_path / "scratch",))

    with pytest.raises(PathOutsideError) as caught:
        with endpoint.downloads_to_disk(Path(folder)):
            pass

    message = str(caught.value)
    assert message.startswith(f"download_to_disk_dir: {folder!r} leads to ")
    assert (
        f"outside the site's workspace and the folders the site allows ({workspace}, {tmp_path / 'scratch'})" in message
    )
    assert message.endswith("or let the site allow a folder that holds it (flengine run --allow-dir DIR)")
    assert not (tmp_path / "escape").exists() and list((tmp_path / "elsewhere").iterdir()) == []


def test_downloads_to_disk_go_to_a_folder_the_site_allows(make_endpoint, workspace: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    endpoint = make_endpoint(workspace, (scratch,)).start()

    with endpoint.downloads_to_disk(scratch / "flengine") as downloads:
        assert endpoint.receives_to_disk
        assert downloads.folder is not None and downloads.folder.parent == scratch / "flengine"

    assert list((scratch / "flengine").iterdir()) == []


@pytest.mark.parametrize(
    ("folder", "expected"),
    [(None, "downloads"), (Path("dl/here"), "dl/here"), (Path("."), ".")],
    ids=["default", "relative", "the-workspace"],
)
def test_download_folders_in_the_workspace_need_no_allowed_folder(
    make_endpoint, workspace: Path, folder: Path | None, expected: str
) -> None:
    endpoint = make_endpoint(workspace)

    assert endpoint.download_folder(folder) == (workspace / expected).resolve()


def test_a_site_allows_only_absolute_folders() -> None:
    with pytest.raises(
        SecurityError, match="site 'server': allowed_dirs: 'scratch' is relative; give absolute folders"
    ):
        SiteSettings("server", insecure=True, allowed_dirs=(Path("scratch"),))
