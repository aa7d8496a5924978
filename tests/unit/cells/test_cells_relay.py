"""RelayTable: the server's memory of requests it forwarded."""

from __future__ import annotations

from engine.cells.relay import MAX_NAME_CHARS, MAX_RELAYED_PER_IDENTITY, MAX_TTL_S, RelayTable


def test_complete_forgets_the_request() -> None:
    relay = RelayTable()
    relay.add("site-1", 7, "site-2", "c", "t", now_s=0.0, timeout_s=10.0)

    assert relay.complete("site-1", 7).target == "site-2"
    assert relay.complete("site-1", 7) is None and len(relay) == 0


def test_a_reply_from_a_cell_the_request_did_not_go_to_leaves_it_waiting() -> None:
    relay = RelayTable()
    relay.add("site-1", 7, "site-2", "c", "t", now_s=0.0, timeout_s=10.0)

    assert relay.complete("site-1", 7, replier="site-3") is None  # a guess at site-1's message id
    assert relay.complete("site-1", 7, replier="site-2").target == "site-2"


def test_drop_target_returns_what_must_be_answered() -> None:
    relay = RelayTable()
    relay.add("site-1", 7, "site-2", "c", "t", now_s=0.0, timeout_s=10.0)
    relay.add("site-3", 8, "site-2", "c", "t", now_s=0.0, timeout_s=10.0)
    relay.add("site-1", 9, "site-4", "c", "t", now_s=0.0, timeout_s=10.0)

    lost = relay.drop_target("site-2")

    assert sorted((r.source, r.msg_id) for r in lost) == [("site-1", 7), ("site-3", 8)]
    assert len(relay) == 1


def test_drop_source_and_expire() -> None:
    relay = RelayTable()
    relay.add("site-1", 1, "site-2", "c", "t", now_s=0.0, timeout_s=2.0)
    relay.add("site-1", 2, "site-2", "c", "t", now_s=0.0, timeout_s=60.0)
    relay.add("site-3", 3, "site-2", "c", "t", now_s=0.0, timeout_s=0.0)  # at least 1 s

    assert relay.expire(now_s=0.5) == 0
    assert relay.expire(now_s=2.0) == 2
    assert relay.drop_source("site-1") == 1 and len(relay) == 0


def test_deadlines_of_answered_requests_do_not_pile_up() -> None:
    relay = RelayTable()
    for i in range(10_000):
        relay.add("site-1", i, "site-2", "c", "t", now_s=0.0, timeout_s=600.0)
        relay.complete("site-1", i)

    assert len(relay._deadlines) < 3000


def test_one_identity_may_have_only_so_many_requests_relayed_and_none_for_ever() -> None:
    relay = RelayTable()
    accepted = [
        relay.add(f"site-1.c{i % 3}", i, "site-2", "x" * 10_000, "t", now_s=0.0, timeout_s=2.0**62)
        for i in range(MAX_RELAYED_PER_IDENTITY + 5)
    ]

    assert accepted.count(True) == MAX_RELAYED_PER_IDENTITY  # child cells share their site's share
    assert relay.add("site-3", 1, "site-2", "c", "t", now_s=0.0, timeout_s=1.0)  # others are not held back
    assert len(relay.complete("site-1.c0", 0).channel) == MAX_NAME_CHARS
    assert relay.add("site-1.c0", 99_999, "site-2", "c", "t", now_s=0.0, timeout_s=1.0)  # one freed, one in
    assert relay.expire(MAX_TTL_S + 1.0) == MAX_RELAYED_PER_IDENTITY + 1  # announced timeouts are clamped
    assert len(relay) == 0
