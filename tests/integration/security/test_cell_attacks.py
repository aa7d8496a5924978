"""Attacks on a secure server cell over real sockets: strangers, impostors, thieves and a man in the
middle. After each one the server still serves the honest site."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from engine.cells import CellSettings, Message, Reply, Status
from engine.cells.envelope import Envelope, decode_envelope, encode_envelope
from engine.cells.protocol import Kind
from engine.errors import AnnouncementRefused, SerializationError, StreamingError
from engine.security import load_secret_key, write_key_pair, write_site_key_folders
from engine.site import SiteEndpoint, SiteSettings
from engine.streaming.pull import download_tensors
from engine.streaming.service import CHANNEL, TOPIC_CHUNK, TOPIC_INFO
from tests.integration.security.zmtp_proxy import ZmtpProxy

SITES = ["site-1", "site-2"]
FAST = CellSettings(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
WAIT_S = 10.0
REFUSAL_S = 3.0


def refusal_of(endpoint: SiteEndpoint) -> str:
    """Why ``endpoint``'s cell was refused: its link error, once it has one; it never connects."""
    deadline = time.monotonic() + WAIT_S
    while not endpoint.cell.link_error and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not endpoint.cell.wait_connected(0.5)
    return endpoint.cell.link_error or ""


class Trust:
    """The keys folders of a server and two sites, and the endpoints a test opens with them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.keys = write_site_key_folders(folder / "keys", "server", SITES)
        self.endpoints: list[SiteEndpoint] = []
        self.server = self.open("server")
        self.server.cell.register_handler("demo", "echo", lambda m: Reply(header={"source": m.source}))
        self.address = self.server.cell.endpoint

    def open(self, site: str, *, keys: Path | None = None, name: str | None = None, address: str | None = None):
        """Start an endpoint of ``site`` (with its own keys unless ``keys`` gives others)."""
        settings = SiteSettings(site, FAST, keys or self.keys[site])
        connect_to = None if site == "server" else (address or self.address)
        endpoint = SiteEndpoint.for_site(settings, {}, connect_to=connect_to, cell_name=name)
        self.endpoints.append(endpoint)
        return endpoint.start()

    def honest_site_is_served(self) -> None:
        """site-1 (connected afresh each time) is answered, as itself."""
        site = self.open("site-1", name=f"site-1.check{len(self.endpoints)}")
        assert site.cell.wait_connected(WAIT_S)
        reply = site.cell.request("server", "demo", "echo", timeout_s=WAIT_S)
        assert reply.header["source"] == site.cell.fqcn

    def close(self) -> None:
        for endpoint in reversed(self.endpoints):
            endpoint.close()


@pytest.fixture
def trust(tmp_path: Path) -> Iterator[Trust]:
    trust = Trust(tmp_path)
    yield trust
    trust.close()


def raw_socket(context: zmq.Context, address: str, keys: tuple[bytes, bytes] | None, server_key: bytes | None):
    """A bare pyzmq DEALER, CURVE when ``keys`` are given: a peer that ignores the cells protocol."""
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
    sock.connect(address)
    return sock


def hello(source: str) -> bytes:
    return encode_envelope(Envelope(Kind.HELLO, 1, source, ""))


def request(source: str, msg_id: int = 2) -> bytes:
    return encode_envelope(Envelope(Kind.REQUEST, msg_id, source, "server", "demo", "echo", timeout_ms=5000))


def replies(sock: zmq.Socket, wait_s: float) -> list[Envelope]:
    got, deadline = [], time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            got.append(decode_envelope(sock.recv_multipart()[0]))
    return got


def test_a_plain_socket_gets_no_byte_through(trust: Trust) -> None:
    context = zmq.Context()
    try:
        sock = raw_socket(context, trust.address, None, None)
        sock.send(hello("site-1"))
        sock.send(request("site-1"))
        heard = replies(sock, REFUSAL_S)
    finally:
        context.destroy(linger=0)

    assert heard == []
    assert "site-1" not in trust.server.cell.peers()
    trust.honest_site_is_served()


def test_a_curve_client_with_an_unknown_key_is_refused_at_the_handshake(trust: Trust) -> None:
    stranger_keys = trust.folder / "stranger"
    write_key_pair(stranger_keys, "site-3")
    (stranger_keys / "server.key").write_bytes((trust.keys["site-1"] / "server.key").read_bytes())

    stranger = trust.open("site-3", keys=stranger_keys)

    assert "not on its allowlist" in refusal_of(stranger)
    assert trust.server.cell.peers() == ()
    trust.honest_site_is_served()


@pytest.mark.parametrize("claimed", ["site-2", "server", "site-2.job", "site-10"])
def test_a_valid_key_cannot_register_as_another_identity(trust: Trust, claimed: str) -> None:
    impostor = trust.open("site-1", name=claimed)

    assert f"authenticated as 'site-1', which may not send as {claimed!r}" in refusal_of(impostor)
    assert claimed not in trust.server.cell.peers()
    assert trust.server.cell.stats()["impersonation"] >= 1
    trust.honest_site_is_served()


def test_envelopes_that_claim_another_name_on_an_authenticated_connection_are_refused(trust: Trust) -> None:
    public, secret = load_secret_key(trust.keys["site-1"] / "site-1.key_secret")
    server_key = trust.server.cell._security.public_key  # noqa: SLF001 - the key the site was given
    context = zmq.Context()
    try:
        sock = raw_socket(context, trust.address, (public, secret), server_key)
        sock.send(hello("site-1"))
        assert [e.status for e in replies(sock, 1.0)] == [Status.OK]  # registered as itself
        for claimed in ("site-2", "server"):
            sock.send(request(claimed, msg_id=7))
        answers = replies(sock, 1.0)
    finally:
        context.destroy(linger=0)

    assert [(a.kind, a.status) for a in answers] == [(Kind.REPLY, Status.ERROR)] * 2
    assert "may not send as 'site-2'" in answers[0].reason and "may not send as 'server'" in answers[1].reason
    trust.honest_site_is_served()


def test_a_download_offered_to_site_1_is_unknown_to_site_2(trust: Trust) -> None:
    tensors = {"w": torch.arange(1000, dtype=torch.float32)}
    assert trust.server.service is not None
    ref = trust.server.service.add_tensors(tensors, chunk_bytes=1024, receivers=["site-1"])
    site1, site2 = trust.open("site-1"), trust.open("site-2")
    assert site1.cell.wait_connected(WAIT_S) and site2.cell.wait_connected(WAIT_S)

    asked = {
        topic: site2.cell.request_async("server", CHANNEL, topic, {"ref": ref, "index": 0}).result(WAIT_S)
        for topic in (TOPIC_INFO, TOPIC_CHUNK)
    }
    never_given = site2.cell.request_async("server", CHANNEL, TOPIC_CHUNK, {"ref": "f" * 32, "index": 0}).result(WAIT_S)
    with pytest.raises(StreamingError, match="unknown or finished download"):
        download_tensors(site2.cell, "server", ref, per_request_timeout_s=WAIT_S)
    received = download_tensors(site1.cell, "server", ref, per_request_timeout_s=WAIT_S)

    for reply in asked.values():  # the same answer as for a ref that never existed: no oracle
        assert (reply.status, reply.reason) == (Status.ERROR, f"unknown or finished download {ref!r}")
    assert (never_given.status, never_given.reason) == (Status.ERROR, f"unknown or finished download {'f' * 32!r}")
    assert torch.equal(received["w"], tensors["w"])


@pytest.mark.parametrize("attack", ["replay", "tamper", "truncate"])
def test_a_replayed_tampered_or_truncated_frame_drops_that_connection_only(trust: Trust, attack: str) -> None:
    proxy = ZmtpProxy(int(trust.address.rsplit(":", 1)[1]), attack).start()
    try:
        victim = trust.open("site-2", address=proxy.endpoint)
        assert victim.cell.wait_connected(WAIT_S)
        seen: list[Message] = []
        trust.server.cell.register_handler("demo", "note", lambda m: seen.append(m))
        proxy.arm()
        victim.cell.send("server", "demo", "note", header={"n": 1})
        assert proxy.attacked.wait(WAIT_S)
        dropped = proxy.dropped_by_server.wait(WAIT_S)
        time.sleep(0.2)
    finally:
        proxy.close()

    assert dropped, "the server kept a connection that sent a forged frame"
    # The forged frame never reached a handler; at most the genuine one did, once.
    assert len(seen) <= 1 and all(dict(m.header) == {"n": 1} for m in seen)
    trust.honest_site_is_served()


def test_a_message_can_only_offer_its_senders_own_data(trust: Trust) -> None:
    site1, site2 = trust.open("site-1"), trust.open("site-2")
    assert site1.cell.wait_connected(WAIT_S) and site2.cell.wait_connected(WAIT_S)
    frames = site2.codec.encode({"w": torch.ones(4096)}, receivers=["server"])  # owner: site-2

    with pytest.raises(SerializationError, match="a message from 'site-1' names 'site-2' as the owner"):
        trust.server.codec.decode(frames, sender="site-1")  # as if site-1 had sent site-2's reference

    assert site2.chunks_served == 0  # refused before anything was asked of site-2
    assert torch.equal(trust.server.codec.decode(frames, sender="site-2")["w"], torch.ones(4096))


def test_a_stream_larger_than_the_receiver_expects_is_refused_before_anything_is_reserved(trust: Trust) -> None:
    site1 = trust.open("site-1")
    assert site1.cell.wait_connected(WAIT_S)
    frames = site1.codec.encode({"w": torch.ones(1 << 20)}, receivers=["server"])  # 4 MiB

    # Refused as the sender's doing (`AnnouncementRefused`): no lost link to wait out.
    with pytest.raises(AnnouncementRefused, match=r"announced \d+ bytes, more than a result of site-1 may hold"):
        trust.server.codec.decode(frames, sender="site-1", max_bytes=1 << 20, what="a result of site-1")

    assert site1.chunks_served == 0
