"""Fuzzing the admin protocol: the requests an admin session sends, the answers it gets back.

Server side: `AdminCommands.handle` of a real, started server daemon (a freshly provisioned
project on 127.0.0.1, two jobs in its store) must answer every request with a reply, ok with
a JSON body or an error with a reason, and never fall back on its last line of defence (an
unexpected exception, logged as "admin command failed"). The requests are what survives the
wire: an envelope encoded and decoded again, with any header an authenticated cell can send.

Admin side: `answer_of` and `download_offer` must return the server's answer or raise
`AdminError` for any reply.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.cells import Message, Reply, Status
from engine.cells.envelope import Envelope, decode_envelope, encode_envelope
from engine.cells.protocol import Kind
from engine.deploy import protocol
from engine.deploy import server as deploy_server
from engine.deploy.admin import AdminError, answer_of, download_offer
from engine.deploy.archive import pack_job
from engine.deploy.commands import AdminCommands
from engine.deploy.server import ServerDaemon
from engine.provision import load_kit, load_project, provision

from .strategies import EDGE_INTS, FUZZ, MSGPACK_VALUES, scaled

FEDAVG = Path(__file__).resolve().parents[2] / "jobs" / "fedavg"
PROJECT = """\
name = fuzz
server {{ host = 127.0.0.1, port = {port}, org = a }}
sites = [ {{ name = site-1, org = a }} ]
admins = [
  {{ name = olga, org = a, role = project_admin }}
  {{ name = alice, org = a, role = lead }}
  {{ name = bob, org = b, role = member }}
]
"""


class FailureLog(logging.Handler):
    """Collects the records of admin commands that failed with an unexpected exception."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.failures.append(self.format(record))


class Server:
    """A started server daemon, the command handlers under test, and what they logged."""

    def __init__(self, root: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        (root / "project.conf").write_text(PROJECT.format(port=port))
        provision(load_project(root / "project.conf"), root / "kits")
        self.daemon = ServerDaemon(load_kit(root / "kits" / "server"), root / "workspace").start()
        self.commands = AdminCommands(self.daemon)
        self.archive = pack_job(FEDAVG, root / "fedavg.zip")
        self.log = FailureLog()
        logging.getLogger("engine.deploy.commands").addHandler(self.log)

    def job_ids(self) -> list[str]:
        """The jobs in the store, two at least: one waiting, one finished (submitted afresh when gone)."""
        records = self.daemon.store.list()
        if len(records) < 2:
            waiting = self.daemon.store.submit(self.archive, "alice", "a")
            ended = self.daemon.store.submit(self.archive, "alice", "a")
            self.daemon.store.update(ended.job_id, status="FINISHED_COMPLETED")
            records = self.daemon.store.list() or [waiting]
        return [record.job_id for record in records]

    def close(self) -> None:
        logging.getLogger("engine.deploy.commands").removeHandler(self.log)
        self.daemon.stop()
        self.daemon.audit.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as patch:
        # No site connects, so no job could start; the scheduler is kept from parsing configs
        # at the same time as the commands do (pyhocon's parser is not thread-safe).
        patch.setattr(deploy_server, "SCHEDULE_INTERVAL_S", 3600.0)
        started = Server(tmp_path_factory.mktemp("admin-fuzz"))
        try:
            yield started
        finally:
            started.close()


COMMANDS = st.sampled_from(
    ["submit", "list", "status", "watch", "abort", "delete", "download", "logs", "clients", "shutdown"]
)
SOURCES = st.sampled_from(["olga.a1", "alice.b2", "bob.c3", "alice", "site-1", "mallory.d4", "olga.a1.x"])
TEXT_ARGS = st.sampled_from(["", "server", "all", "site-1", "../../etc/passwd", "a" * 12, "a" * 300, "\x1b[2J", "%s"])
ARG_VALUES = TEXT_ARGS | EDGE_INTS | MSGPACK_VALUES


@st.composite
def requests(draw: st.DrawFn, job_ids: list[str]) -> dict[str, Any]:
    """A command header: a known or unknown command, its args of any type, some extra keys."""
    header: dict[str, Any] = {"command": draw(COMMANDS | TEXT_ARGS | MSGPACK_VALUES)}
    for key in draw(
        st.lists(st.sampled_from(["job_id", "ref", "size", "digest", "site", "target", "offset"]), max_size=4)
    ):
        if key == "job_id" and draw(st.booleans()):  # by position: the store's jobs change from example to example
            header[key] = job_ids[draw(st.integers(0, 3)) % len(job_ids)]
        else:
            header[key] = draw(ARG_VALUES)
    if draw(st.booleans()):
        header[draw(st.text(max_size=6))] = draw(MSGPACK_VALUES)
    if header["command"] == "shutdown" and header.get("target", "server") in ("server", "all"):
        header["target"] = "site-1"  # a shutdown of the server would stop it for the examples after
    return header


def as_received(source: str, header: dict[str, Any]) -> Message:
    """The request as the server's cell hands it over: its envelope through the wire codec."""
    envelope = Envelope(
        Kind.REQUEST, 7, source, "server", protocol.ADMIN_CHANNEL, protocol.TOPIC_COMMAND, header=header
    )
    return Message(decode_envelope(encode_envelope(envelope)))


@scaled(30)
@given(source=SOURCES, request=st.data())
def test_every_request_gets_a_reply_and_none_fails_unexpectedly(
    server: Server, source: str, request: st.DataObject
) -> None:
    # Arrange
    header = request.draw(requests(server.job_ids()))
    failures_before = len(server.log.failures)

    # Act
    reply = server.commands.handle(as_received(source, header))

    # Assert
    assert isinstance(reply, Reply)
    assert server.log.failures[failures_before:] == []
    if reply.status is Status.OK:
        json.loads(bytes(reply.frames[0]))
    else:
        assert reply.status is Status.ERROR and reply.reason


REPLY_FRAMES = st.lists(
    st.binary(max_size=30)
    | st.sampled_from([b"[" * 100_000, b"\xff\xfe", b'{"ref": 1}', b"null", b"[]", b'"x"'])
    | st.builds(lambda v: json.dumps(v, default=repr).encode(), MSGPACK_VALUES),
    max_size=2,
)


@FUZZ
@given(
    status=st.sampled_from([Status.OK, Status.ERROR, Status.TIMEOUT, Status.UNREACHABLE]),
    reason=st.text(max_size=20),
    frames=REPLY_FRAMES,
)
# Crashes found by this property: deep JSON raised RecursionError, bytes that are not text
# UnicodeDecodeError, anything else not JSON JSONDecodeError.
@example(status=Status.OK, reason="", frames=[b"[" * 100_000])
@example(status=Status.OK, reason="", frames=[b"\xff\xfe\x00"])
@example(status=Status.OK, reason="", frames=[b"{"])
def test_answer_of_returns_the_json_answer_or_raises_admin_error(
    status: Status, reason: str, frames: list[bytes]
) -> None:
    envelope = Envelope(Kind.REPLY, 3, "server", "alice.b2", status=status, reason=reason)
    reply = Message(decode_envelope(encode_envelope(envelope)), tuple(memoryview(f) for f in frames))

    try:
        answer = answer_of("status", reply)
    except AdminError as e:
        assert str(e)
        return
    assert status is Status.OK
    json.dumps(answer)  # what the admin tool prints: JSON again


@FUZZ
@given(
    answer=MSGPACK_VALUES
    | st.fixed_dictionaries({"ref": ARG_VALUES, "size": ARG_VALUES}, optional={"digest": ARG_VALUES, "x": ARG_VALUES})
)
# Crashes found by this property: a list or None raised AttributeError, a dict without a ref KeyError.
@example(answer=[1, 2])
@example(answer=None)
@example(answer={"size": 10})
def test_download_offer_is_read_or_refused_with_admin_error(answer: Any) -> None:
    try:
        ref, size, digest = download_offer(answer)
    except AdminError as e:
        assert "download" in str(e)
        return
    assert isinstance(ref, str) and type(size) is int and size > 0 and isinstance(digest, str)


def test_an_answer_that_is_not_json_is_an_admin_error() -> None:
    envelope = Envelope(Kind.REPLY, 3, "server", "alice.b2")
    reply = Message(envelope, (memoryview(b"[" * 100_000),))

    with pytest.raises(AdminError, match=r"^status: the server's answer is not JSON \(RecursionError"):
        answer_of("status", reply)
