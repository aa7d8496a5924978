"""PendingRequests: each request resolves exactly once, by reply, failure or deadline."""

from __future__ import annotations

from engine.cells.envelope import Envelope
from engine.cells.message import Message
from engine.cells.pending import PendingRequests
from engine.cells.protocol import Kind, Status


def _reply(reply_to: int, source: str = "site-2") -> Message:
    return Message(Envelope(Kind.REPLY, 99, source, "site-1", "task", "get", reply_to=reply_to))


def test_reply_resolves_its_request_once() -> None:
    pending = PendingRequests("site-1")
    future = pending.add(5, "site-2", "task", "get", now_s=0.0, timeout_s=10.0)

    assert pending.resolve(_reply(5))
    assert not pending.resolve(_reply(5))
    assert future.result(0).envelope.reply_to == 5
    assert future.msg_id == 5 and len(pending) == 0


def test_reply_from_another_cell_is_ignored() -> None:
    pending = PendingRequests("site-1")
    future = pending.add(5, "site-2", "task", "get", now_s=0.0, timeout_s=10.0)

    assert not pending.resolve(_reply(5, source="site-3"))
    assert not future.done()


def test_unknown_reply_is_ignored() -> None:
    assert not PendingRequests("site-1").resolve(_reply(123))


def test_fail_makes_a_reply_in_the_targets_name() -> None:
    pending = PendingRequests("site-1")
    future = pending.add(5, "site-2", "task", "get", now_s=0.0, timeout_s=10.0)

    assert pending.fail(5, Status.UNREACHABLE, "server: gone")
    assert not pending.fail(5, Status.UNREACHABLE, "again")

    reply = future.result(0)
    assert (reply.source, reply.target, reply.channel, reply.topic) == ("site-2", "site-1", "task", "get")
    assert (reply.status, reply.reason) == (Status.UNREACHABLE, "server: gone")


def test_fail_target_only_touches_that_target() -> None:
    pending = PendingRequests("site-1")
    to_2 = [pending.add(i, "site-2", "c", "t", now_s=0.0, timeout_s=10.0) for i in range(3)]
    to_3 = pending.add(10, "site-3", "c", "t", now_s=0.0, timeout_s=10.0)

    assert pending.fail_target("site-2", Status.UNREACHABLE, "lost") == 3

    assert all(f.result(0).status is Status.UNREACHABLE for f in to_2)
    assert not to_3.done() and len(pending) == 1


def test_expire_times_out_only_what_is_due() -> None:
    pending = PendingRequests("site-1")
    early = pending.add(1, "site-2", "c", "t", now_s=0.0, timeout_s=1.0)
    late = pending.add(2, "site-2", "c", "t", now_s=0.0, timeout_s=5.0)
    pending.resolve(_reply(1))  # resolved entries leave stale deadlines behind

    assert pending.next_deadline_s() == 1.0
    assert pending.expire(now_s=2.0) == 0
    assert pending.expire(now_s=5.0) == 1

    assert early.result(0).status is Status.OK
    assert late.result(0).status is Status.TIMEOUT
    assert "no reply within 5 s" in late.result(0).reason
    assert pending.next_deadline_s() is None


def test_cancelled_future_does_not_break_resolution() -> None:
    pending = PendingRequests("site-1")
    future = pending.add(1, "site-2", "c", "t", now_s=0.0, timeout_s=1.0)
    future.cancel()

    assert pending.resolve(_reply(1))


def test_deadlines_of_resolved_requests_do_not_pile_up() -> None:
    pending = PendingRequests("site-1")
    for i in range(10_000):
        pending.add(i, "site-2", "c", "t", now_s=0.0, timeout_s=600.0)
        pending.resolve(_reply(i))

    assert len(pending._deadlines) < 3000
