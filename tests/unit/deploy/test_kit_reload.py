"""A re-provisioned server kit picked up while the server runs: what `KitWatcher` loads, and the
server daemon revoking a site that left the kit (its cells told BYE, the scheduler unharmed).

The daemon runs for real on 127.0.0.1 from a deployed copy of its kit, and the sites connect
with their own kits' keys; its scheduler and reload threads are slowed to a stop so that the
test calls each step itself.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.deploy import protocol
from engine.deploy import server as deploy_server
from engine.deploy.admin import AdminSession
from engine.deploy.audit import read
from engine.deploy.kit_reload import KitWatcher
from engine.deploy.server import ServerDaemon
from engine.errors import SecurityError
from engine.provision import load_kit, load_project, provision
from engine.site import SiteEndpoint, SiteSettings

FEDAVG = Path(__file__).resolve().parents[3] / "jobs" / "fedavg"
WAIT_S = 10.0
PROJECT = """\
name = reload
server {{ host = 127.0.0.1, port = {port}, org = a }}
sites = [ {sites} ]
admins = [ {{ name = olga, org = a, role = project_admin }} ]
"""


class Project:
    """A project admin's folder (``project.conf``, ``kits/``) and the server kit deployed from it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.kits = root / "kits"
        self.deployed = root / "deployed" / "server"
        self.provision("site-1", "site-2")
        shutil.copytree(self.kits / "server", self.deployed)

    def provision(self, *sites: str) -> None:
        listed = ", ".join(f"{{ name = {site}, org = a }}" for site in sites)
        (self.root / "project.conf").write_text(PROJECT.format(port=self.port, sites=listed), encoding="utf-8")
        provision(load_project(self.root / "project.conf"), self.kits, remove=True)

    def copy_over(self) -> None:
        """Copy the new server kit over the deployed one, as the README's "copy over" does."""
        shutil.copytree(self.kits / "server", self.deployed, dirs_exist_ok=True)


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_an_unchanged_kit_is_not_loaded_again_and_a_changed_one_says_who_left(project: Project) -> None:
    watcher = KitWatcher(load_kit(project.deployed), ["olga", "site-1", "site-2"])
    assert watcher.poll() is None

    project.provision("site-1", "site-3")
    project.copy_over()
    change = watcher.poll()

    assert change is not None
    assert (change.added, change.removed) == (["site-3"], ["site-2"])
    assert change.allowlist.identities() == ["olga", "site-1", "site-3"]
    assert sorted(change.participants) == ["olga", "server", "site-1", "site-3"]
    assert change.kit.ignored_files == ("keys/allowlist/site-2.key",)
    assert watcher.poll() is None


def test_a_kit_still_being_copied_is_retried_and_reported_once_only_when_it_stays_broken(project: Project) -> None:
    clock = Clock()
    watcher = KitWatcher(load_kit(project.deployed), ["olga", "site-1", "site-2"], settle_s=3.0, clock=clock)
    project.provision("site-1")
    shutil.copy2(project.kits / "server" / "MANIFEST.json", project.deployed / "MANIFEST.json")  # half copied

    assert watcher.poll() is None  # a copy in progress is not an error
    clock.now_s = 3.5
    with pytest.raises(SecurityError, match="participants.json: changed since the kit was provisioned"):
        watcher.poll()
    clock.now_s = 10.0
    assert watcher.poll() is None  # reported once per version of the manifest
    project.copy_over()  # the copy is whole now
    change = watcher.poll()
    assert change is not None and change.removed == ["site-2"]


@pytest.fixture
def daemon(project: Project, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerDaemon]:
    monkeypatch.setattr(deploy_server, "SCHEDULE_INTERVAL_S", 3600.0)  # the test runs each step itself
    daemon = ServerDaemon(load_kit(project.deployed), project.root / "server-workspace").start()
    yield daemon
    daemon.stop()
    daemon.audit.close()


def connect(kit_folder: Path) -> SiteEndpoint:
    """A site's cell, connected to the server with the keys of the kit in ``kit_folder``."""
    kit = load_kit(kit_folder)
    settings = SiteSettings(kit.identity, kit.cell_settings(), kit.keys_dir)
    return SiteEndpoint.for_site(settings, {}, connect_to=kit.server.connect_address).start()


def send_status(endpoint: SiteEndpoint) -> None:
    endpoint.cell.send("server", protocol.SITE_CHANNEL, protocol.TOPIC_STATUS, {"running": []})


def wait_for(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_site_removed_by_copying_the_new_kit_over_is_cut_off_and_the_scheduler_goes_on(
    project: Project, daemon: ServerDaemon
) -> None:
    site_2_kit = shutil.copytree(project.kits / "site-2", project.root / "deployed" / "site-2")  # its owner's copy
    sites = {"site-1": connect(project.kits / "site-1"), "site-2": connect(site_2_kit)}
    try:
        for endpoint in sites.values():
            assert endpoint.cell.wait_connected(WAIT_S)
            send_status(endpoint)
        wait_for(lambda: sorted(daemon.connected_sites()) == ["site-1", "site-2"], "both sites")
        with AdminSession(load_kit(project.kits / "olga")) as olga:
            job_id = olga.submit(FEDAVG)["job_id"]  # queued: the scheduler looks at it below

        project.provision("site-1")
        project.copy_over()
        reloaded = daemon.reload_kit_if_changed()
        daemon._schedule_once()  # raised KeyError on participants["site-2"] before the fix

        assert reloaded
        assert sorted(daemon.connected_sites()) == ["site-1"]
        assert daemon.waiting_reason(job_id) == "waiting for clients: 1 of min_clients = 2 can take it now"
        revoked = sites["site-2"].cell
        wait_for(lambda: not revoked.connected, "the server to close site-2's registration", timeout_s=2.0)
        assert revoked.link_error == "server: the key of 'site-2' is no longer on the allowlist"
        assert "site-2" not in daemon.endpoint.cell.peers()
        events = [(e["action"], e["outcome"], e.get("removed"), e.get("files")) for e in read(daemon.audit.path)]
        assert ("kit_files_ignored", "ok", None, ["keys/allowlist/site-2.key"]) in events
        assert ("reload", "ok", ["site-2"], None) in events
        again = connect(site_2_kit)  # a new connection with the revoked key: refused at the handshake
        try:
            assert not again.cell.wait_connected(1.0)
            assert "refused this cell's key" in str(again.cell.link_error)
        finally:
            again.close()
    finally:
        for endpoint in sites.values():
            endpoint.close()
