"""A simulation's worker key speaks for its own virtual clients and no one else's (`Allowlist.delegate`)."""

from __future__ import annotations

import pytest
import zmq

from engine.cells import Cell, CellSettings
from engine.cells.security import Allowlist, CellSecurity

WORKER_1, WORKER_2, SERVER = zmq.curve_keypair(), zmq.curve_keypair(), zmq.curve_keypair()


def delegated_allowlist() -> Allowlist:
    allowlist = Allowlist({"worker-1": WORKER_1[0], "worker-2": WORKER_2[0]})
    allowlist.delegate({"worker-1": ["site-1", "site-3"], "worker-2": ["site-2"]})
    return allowlist


@pytest.mark.parametrize(
    ("identity", "fqcn", "owned"),
    [
        ("worker-1", "worker-1", True),
        ("worker-1", "site-1", True),
        ("worker-1", "site-3.script", True),
        ("worker-1", "site-2", False),  # worker-2's client
        ("worker-1", "site-13", False),
        ("worker-1", "server", False),
        ("worker-1", "worker-2", False),
        ("worker-2", "site-1", False),
    ],
)
def test_a_worker_owns_its_name_and_its_clients_names(identity: str, fqcn: str, owned: bool) -> None:
    assert delegated_allowlist().owns(identity, fqcn) is owned


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"worker-1": ["site-1"], "worker-2": ["site-1"]}, "given to both"),
        ({"worker-1": [""]}, "expected site names"),
        ({"worker-1": ["site-1.child"]}, "expected site names"),
    ],
)
def test_a_bad_delegation_is_refused_whole(table: dict, match: str) -> None:
    allowlist = delegated_allowlist()
    with pytest.raises(ValueError, match=match):
        allowlist.delegate(table)
    assert allowlist.owns("worker-1", "site-1")  # the earlier delegation stands


def connect(server: Cell, name: str, keys: tuple[bytes, bytes]) -> Cell:
    security = CellSecurity(keys[0], keys[1], server_public_key=SERVER[0])
    cell = Cell(name, CellSettings(heartbeat_timeout_s=5.0), connect_to=server.endpoint, security=security)
    return cell.start()


def test_over_curve_a_worker_key_registers_its_clients_cells_and_is_refused_another_workers() -> None:
    security = CellSecurity(SERVER[0], SERVER[1], allowlist=delegated_allowlist())
    with Cell("server", CellSettings(host="127.0.0.1", port=0), security=security) as server:
        own = connect(server, "site-3", WORKER_1)
        other = connect(server, "site-2", WORKER_1)  # worker-2's client, with worker-1's key
        try:
            assert own.wait_connected(5.0)
            assert not other.wait_connected(2.0)
            assert "may not send as 'site-2'" in (other.link_error or "")
            assert "site-3" in server.peers() and "site-2" not in server.peers()
        finally:
            own.stop()
            other.stop()
