"""PeerTable: registration outcomes, lookups, expiry."""

from __future__ import annotations

from engine.cells.peers import PeerTable, Registration


def test_new_then_refreshed() -> None:
    table = PeerTable()

    assert table.register("site-1", b"r1", now_s=1.0) is Registration.NEW
    assert table.register("site-1", b"r1", now_s=2.0) is Registration.REFRESHED
    assert table.get("site-1").last_seen_s == 2.0
    assert table.fqcn_of(b"r1") == "site-1" and "site-1" in table and len(table) == 1


def test_reconnect_moves_the_name_to_the_new_connection() -> None:
    table = PeerTable()
    table.register("site-1", b"old", now_s=1.0)

    outcome = table.register("site-1", b"new", now_s=2.0)

    assert outcome is Registration.MOVED
    assert table.get("site-1").routing_id == b"new"
    assert table.fqcn_of(b"old") is None and table.fqcn_of(b"new") == "site-1"


def test_connection_cannot_claim_a_second_name() -> None:
    table = PeerTable()
    table.register("site-1", b"r1", now_s=1.0)

    assert table.register("site-2", b"r1", now_s=2.0) is Registration.REFUSED
    assert table.names() == ["site-1"]


def test_name_bound_to_a_credential_refuses_another() -> None:
    table = PeerTable()
    table.register("site-1", b"r1", now_s=1.0, credential=b"key-A")

    assert table.register("site-1", b"r2", now_s=2.0, credential=b"key-B") is Registration.REFUSED
    assert table.register("site-1", b"r2", now_s=2.0, credential=b"key-A") is Registration.MOVED


def test_touch_remove_and_expire() -> None:
    table = PeerTable()
    table.register("site-1", b"r1", now_s=0.0)
    table.register("site-2", b"r2", now_s=0.0)
    table.touch("site-2", now_s=9.0)
    table.touch("ghost", now_s=9.0)

    gone = table.expire(now_s=10.0, timeout_s=5.0)

    assert [p.fqcn for p in gone] == ["site-1"]
    assert table.names() == ["site-2"] and table.fqcn_of(b"r1") is None
    assert table.remove("site-2").routing_id == b"r2"
    assert table.remove("site-2") is None and len(table) == 0
