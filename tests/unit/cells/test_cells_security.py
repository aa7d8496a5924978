"""CURVE trust in the cells layer without sockets: the allowlist, the ZAP handler, and the server
core binding every name to the identity of the key that sent it."""

from __future__ import annotations

import itertools

import pytest
import zmq
import zmq.utils.z85

from engine.cells.core import Send
from engine.cells.envelope import Envelope, decode_envelope, encode_envelope
from engine.cells.handlers import HandlerRegistry
from engine.cells.message import Reply
from engine.cells.pending import PendingRequests
from engine.cells.protocol import MAX_CELLS_PER_IDENTITY, Kind, Status
from engine.cells.security import ZAP_DOMAIN, Allowlist, CellSecurity, ZapHandler, name_owned_by
from engine.cells.server_core import ServerCore
from engine.cells.settings import CellSettings

_ids = itertools.count(1)
SITE_1, SITE_2 = zmq.curve_keypair(), zmq.curve_keypair()


def raw(public_key: bytes) -> bytes:
    return zmq.utils.z85.decode(public_key)


def zap_request(public_key: bytes, mechanism: bytes = b"CURVE", domain: bytes = ZAP_DOMAIN) -> list[bytes]:
    return [b"1.0", b"7", domain, b"10.0.0.9", b"", mechanism, raw(public_key)]


@pytest.mark.parametrize(
    ("identity", "fqcn", "owned"),
    [
        ("site-1", "site-1", True),
        ("site-1", "site-1.job-7", True),
        ("site-1", "site-10", False),
        ("site-1", "site-2", False),
        ("site-1", "server", False),
        ("server", "server.job", True),
    ],
    ids=["itself", "its-child", "name-prefix-is-not-a-child", "another-site", "the-server", "server-child"],
)
def test_an_identity_owns_its_name_and_its_children(identity: str, fqcn: str, owned: bool) -> None:
    assert name_owned_by(identity, fqcn) is owned


def test_the_allowlist_maps_each_key_to_one_identity() -> None:
    allowlist = Allowlist({"site-1": SITE_1[0], "site-2": SITE_2[0].decode()})

    assert allowlist.identity_of_raw(raw(SITE_1[0])) == "site-1"
    assert allowlist.identity_of_raw(raw(SITE_2[0])) == "site-2"
    assert allowlist.identity_of_raw(b"\0" * 32) is None
    assert allowlist.identities() == ["site-1", "site-2"]


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"site-1": SITE_1[0], "site-2": SITE_1[0]}, "'site-2' and 'site-1' have the same public key"),
        ({"site-1": b"short"}, r"allowlist\['site-1'\]: expected a CURVE key of 40 Z85 characters"),
        ({"": SITE_1[0]}, "identity must be a non-empty string"),
    ],
    ids=["one-key-two-identities", "not-a-key", "empty-identity"],
)
def test_a_bad_allowlist_is_refused_whole(table: dict, match: str) -> None:
    allowlist = Allowlist({"site-1": SITE_1[0]})

    with pytest.raises(ValueError, match=match):
        allowlist.replace(table)

    assert allowlist.identities() == ["site-1"]  # unchanged


def test_zap_accepts_an_allowlisted_key_and_names_its_identity() -> None:
    handler = ZapHandler(Allowlist({"site-1": SITE_1[0]}), "server")

    assert handler.answer(zap_request(SITE_1[0])) == [b"1.0", b"7", b"200", b"OK", b"site-1", b""]


@pytest.mark.parametrize(
    "request_frames",
    [
        zap_request(SITE_2[0]),
        zap_request(SITE_1[0], mechanism=b"PLAIN"),
        zap_request(SITE_1[0], domain=b"other"),
        [b"1.0", b"7", ZAP_DOMAIN, b"addr", b"", b"CURVE", b"not 32 bytes"],
    ],
    ids=["unknown-key", "other-mechanism", "other-domain", "malformed-key"],
)
def test_zap_refuses_everything_else_with_400(request_frames: list[bytes]) -> None:
    handler = ZapHandler(Allowlist({"site-1": SITE_1[0]}), "server")

    answer = handler.answer(request_frames)

    assert answer[:3] == [b"1.0", b"7", b"400"] and answer[4] == b""
    assert handler.refused == 1


def test_zap_answers_a_truncated_request_instead_of_raising() -> None:
    assert ZapHandler(Allowlist({"site-1": SITE_1[0]}), "server").answer([b"1.0", b"9"])[2] == b"500"


def test_cell_security_is_either_a_server_or_a_client() -> None:
    server_public, server_secret = zmq.curve_keypair()
    with pytest.raises(ValueError, match="give a server_public_key .client cell. or an allowlist"):
        CellSecurity(server_public, server_secret)
    with pytest.raises(ValueError, match="secret_key: expected a CURVE key"):
        CellSecurity(server_public, b"x" * 39, server_public_key=server_public)


def secure_server() -> ServerCore:
    handlers = HandlerRegistry()
    handlers.register("demo", "echo", lambda m: Reply(header={"from": m.source}))
    return ServerCore(
        "server",
        CellSettings(),
        handlers=handlers,
        pending=PendingRequests("server"),
        next_id=lambda: next(_ids),
        authenticated=True,
    )


def frames_of(kind: Kind, source: str, **fields) -> list[bytes]:
    return [encode_envelope(Envelope(kind, next(_ids), source, "server", **fields))]


def answers(actions: list) -> list[Envelope]:
    return [decode_envelope(a.frames[0]) for a in actions if isinstance(a, Send)]


def test_a_connection_registers_only_names_its_key_owns() -> None:
    core = secure_server()

    own = answers(core.on_frames(b"c1", frames_of(Kind.HELLO, "site-1"), 0.0, "site-1"))
    child = answers(core.on_frames(b"c2", frames_of(Kind.HELLO, "site-1.job"), 0.0, "site-1"))
    other = answers(core.on_frames(b"c3", frames_of(Kind.HELLO, "site-2"), 0.0, "site-1"))

    assert [a.status for a in own + child] == [Status.OK, Status.OK]
    assert (other[0].kind, other[0].status) == (Kind.HELLO_ACK, Status.ERROR)
    assert "authenticated as 'site-1', which may not send as 'site-2'" in other[0].reason
    assert core.peer_names() == ("site-1", "site-1.job")
    assert core.stats()["impersonation"] == 1


def test_a_message_without_an_identity_or_with_another_source_is_refused_and_answered() -> None:
    core = secure_server()
    core.on_frames(b"c1", frames_of(Kind.HELLO, "site-1"), 0.0, "site-1")
    request = {"channel": "demo", "topic": "echo", "timeout_ms": 1000}

    spoofed = answers(core.on_frames(b"c1", frames_of(Kind.REQUEST, "site-2", **request), 0.0, "site-1"))
    anonymous = core.on_frames(b"c9", frames_of(Kind.REQUEST, "site-1", **request), 0.0, None)
    honest = core.on_frames(b"c1", frames_of(Kind.REQUEST, "site-1", **request), 0.0, "site-1")

    assert [(a.kind, a.status) for a in spoofed] == [(Kind.REPLY, Status.ERROR)]
    assert "may not send as 'site-2'" in spoofed[0].reason
    assert "authenticated as None" in answers(anonymous)[0].reason
    assert [type(a).__name__ for a in honest] == ["Dispatch"]
    assert core.stats()["impersonation"] == 2


def test_a_second_connection_of_the_same_identity_replaces_the_first() -> None:
    core = secure_server()
    core.on_frames(b"old", frames_of(Kind.HELLO, "site-1"), 0.0, "site-1")

    core.on_frames(b"new", frames_of(Kind.HELLO, "site-1"), 1.0, "site-1")
    stale = answers(
        core.on_frames(
            b"old", frames_of(Kind.REQUEST, "site-1", channel="demo", topic="echo", timeout_ms=9), 1.0, "site-1"
        )
    )

    assert core._peers.get("site-1").routing_id == b"new"  # noqa: SLF001
    assert stale[0].status is Status.ERROR and "connection is not registered" in stale[0].reason


def test_one_identity_may_register_only_so_many_cells() -> None:
    core = secure_server()
    acks = [
        answers(core.on_frames(f"c{i}".encode(), frames_of(Kind.HELLO, f"site-1.job{i}"), 0.0, "site-1"))[0]
        for i in range(MAX_CELLS_PER_IDENTITY + 1)
    ]

    assert [a.status for a in acks[:-1]] == [Status.OK] * MAX_CELLS_PER_IDENTITY
    assert acks[-1].status is Status.ERROR and "cells registered already" in acks[-1].reason
    other = answers(core.on_frames(b"x", frames_of(Kind.HELLO, "site-2"), 0.0, "site-2"))
    assert other[0].status is Status.OK  # another site is not affected


def test_a_connection_whose_identity_leaves_the_allowlist_is_refused_from_then_on() -> None:
    allowlist = Allowlist({"site-1": SITE_1[0], "site-2": SITE_2[0]})
    handlers = HandlerRegistry()
    handlers.register("demo", "echo", lambda m: Reply())
    core = ServerCore(
        "server",
        CellSettings(),
        handlers=handlers,
        pending=PendingRequests("server"),
        next_id=lambda: next(_ids),
        authenticated=True,
        still_allowed=allowlist.has_identity,
    )
    request = {"channel": "demo", "topic": "echo", "timeout_ms": 1000}
    for connection, site in ((b"c1", "site-1"), (b"c2", "site-2")):
        core.on_frames(connection, frames_of(Kind.HELLO, site), 0.0, site)

    allowlist.replace({"site-1": SITE_1[0]})  # site-2 revoked: its open connection stays open in ZeroMQ
    revoked = answers(core.on_frames(b"c2", frames_of(Kind.REQUEST, "site-2", **request), 1.0, "site-2"))
    kept = core.on_frames(b"c1", frames_of(Kind.REQUEST, "site-1", **request), 1.0, "site-1")

    assert (revoked[0].status, revoked[0].reason) == (
        Status.ERROR,
        "server: the key of 'site-2' is no longer on the allowlist",
    )
    assert core.peer_names() == ("site-1",)
    assert [type(a).__name__ for a in kept] == ["Dispatch"]
    assert core.stats()["revoked"] == 1
    hello = answers(core.on_frames(b"c2", frames_of(Kind.HELLO, "site-2"), 2.0, "site-2"))
    assert (hello[0].kind, hello[0].status) == (Kind.HELLO_ACK, Status.ERROR)


def test_the_cells_of_a_revoked_identity_are_told_bye_at_the_next_sweep_without_a_message_of_theirs() -> None:
    allowlist = Allowlist({"site-1": SITE_1[0], "site-2": SITE_2[0]})
    core = ServerCore(
        "server",
        CellSettings(),
        handlers=HandlerRegistry(),
        pending=PendingRequests("server"),
        next_id=lambda: next(_ids),
        authenticated=True,
        still_allowed=allowlist.has_identity,
    )
    for connection, name, identity in ((b"c1", "site-1", "site-1"), (b"c2", "site-2", "site-2"),
                                       (b"c3", "site-2.job", "site-2")):  # fmt: skip
        core.on_frames(connection, frames_of(Kind.HELLO, name), 0.0, identity)
    assert core.on_tick(1.0) == []  # nobody revoked: the sweep sends nothing

    allowlist.replace({"site-1": SITE_1[0]})
    actions = core.on_tick(2.0)

    byes = [(a.routing_id, decode_envelope(a.frames[0])) for a in actions if isinstance(a, Send)]
    assert [(routing_id, bye.kind, bye.target) for routing_id, bye in byes] == [
        (b"c2", Kind.BYE, "site-2"),
        (b"c3", Kind.BYE, "site-2.job"),
    ]
    assert byes[0][1].reason == "server: the key of 'site-2' is no longer on the allowlist"
    assert core.peer_names() == ("site-1",)
    assert core.stats()["revoked"] == 2
    assert core.on_tick(3.0) == []


def test_keep_only_narrows_the_allowlist_to_the_given_identities() -> None:
    allowlist = Allowlist({"site-1": SITE_1[0], "site-2": SITE_2[0]})

    allowlist.keep_only({"site-2", "site-9"})

    assert allowlist.identities() == ["site-2"]
    assert allowlist.identity_of_raw(raw(SITE_1[0])) is None
    assert not allowlist.has_identity("site-1") and allowlist.has_identity("site-2")
