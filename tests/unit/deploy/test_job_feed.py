"""`watch` and `logs --follow` on the server: reads from a cursor, bounded whatever the cursor says,
and authorized and audited as `status` and `logs` are.

The pure reads are driven on files; the commands go to a real server daemon over the network
(the `Server` of test_commands: provisioned kits, admins connecting with their own keys).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.deploy.audit import read
from engine.deploy.commands import unknown_job
from engine.deploy.job_feed import FEED_MAX_BYTES, Chunk, cursor_of, read_from, tail
from engine.deploy.server import ServerDaemon
from engine.errors import UsageError
from tests.unit.deploy.test_commands import Server, answer, ask, audited, daemon, fedavg_zip, server, submit  # noqa: F401

# ----------------------------------------------------------------- reads from a cursor


@pytest.mark.parametrize(
    ("content", "offset", "expected"),
    [
        (b"", 0, Chunk([], 0, False)),
        (b"a\nb\n", 0, Chunk(["a", "b"], 4, False)),
        (b"a\nb\n", 2, Chunk(["b"], 4, False)),
        (b"a\nhalf", 0, Chunk(["a"], 2, False)),
        (b"a\nhalf", 2, Chunk([], 2, False)),
        (b"a\nb\n", 99, Chunk([], 4, False)),
        (b"caf\xc3\xa9\n\xff\n", 0, Chunk(["café", "\ufffd"], 8, False)),
        (b"ok\rforged\n", 0, Chunk(["ok\rforged"], 10, False)),
    ],
    ids=["empty", "lines", "from-a-cursor", "a-line-being-written", "only-a-line-being-written",
         "cursor-past-the-end", "utf8-and-bad-bytes", "carriage-return-kept"],
)  # fmt: skip
def test_read_from_returns_the_complete_lines_after_the_cursor(
    tmp_path: Path, content: bytes, offset: int, expected: Chunk
) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(content)

    assert read_from(path, offset) == expected


def test_read_from_reads_at_most_max_bytes_and_says_there_is_more(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))

    chunks, offset = [], 0
    while True:
        chunk = read_from(path, offset, max_bytes=100)
        chunks.append(chunk)
        offset = chunk.offset
        if not chunk.more:
            break

    assert [line for chunk in chunks for line in chunk.lines] == [f"line {i}" for i in range(1000)]
    assert all(chunk.more for chunk in chunks[:-1]) and len(chunks) > 50


def test_a_line_longer_than_a_read_comes_in_pieces_and_the_cursor_moves_on(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    path.write_bytes(b"x" * 250 + b"\nnext\n")

    first = read_from(path, 0, max_bytes=100)
    second = read_from(path, first.offset, max_bytes=100)

    assert first == Chunk(["x" * 100], 100, True)
    assert second == Chunk(["x" * 100], 200, True)
    assert read_from(path, second.offset, max_bytes=100) == Chunk(["x" * 50, "next"], 256, False)


def test_a_file_not_written_yet_has_no_lines_and_keeps_the_cursor(tmp_path: Path) -> None:
    assert read_from(tmp_path / "missing.jsonl", 0) == Chunk([], 0, False)
    assert tail(tmp_path / "missing.txt") == Chunk([], 0, False)


def test_tail_gives_the_last_lines_and_the_cursor_after_them(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    complete = b"".join(b"line %d\n" % i for i in range(500))
    path.write_bytes(complete + b"half")

    chunk = tail(path, lines=3)

    assert chunk.lines == ["line 497", "line 498", "line 499"]
    assert chunk.offset == len(complete)  # the line being written comes with the next read, whole
    assert read_from(path, chunk.offset) == Chunk([], len(complete), False)


@pytest.mark.parametrize(
    ("header", "expected"),
    [({}, None), ({"offset": None}, None), ({"offset": 0}, 0), ({"offset": 12345}, 12345)],
    ids=["absent", "null", "zero", "an-offset"],
)
def test_cursor_of_takes_an_absent_or_a_byte_offset(header: dict[str, Any], expected: int | None) -> None:
    assert cursor_of(header) == expected


@pytest.mark.parametrize(
    "value",
    [-1, 1 << 63, "12", 1.5, True, [1], {"a": 1}],
    ids=["negative", "too-big", "string", "float", "bool", "list", "object"],
)
def test_a_cursor_that_is_not_a_byte_offset_is_a_usage_error(value: object) -> None:
    with pytest.raises(UsageError, match=r"^offset: expected a byte offset from 0 to 2\*\*62, got "):
        cursor_of({"offset": value})


# ----------------------------------------------------------------- watch on a server


@pytest.fixture
def job_id(server: Server, fedavg_zip: Path) -> str:  # noqa: F811
    return answer(submit(server.admin("alice"), fedavg_zip))["job_id"]


def events_file(daemon: ServerDaemon, job_id: str) -> Path:  # noqa: F811
    folder = daemon.store.workspace(job_id) / "server"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "events.jsonl"


def test_watch_answers_the_record_and_each_new_event_from_the_cursor(
    server: Server,  # noqa: F811
    daemon: ServerDaemon,  # noqa: F811
    job_id: str,
) -> None:
    alice = server.admin("alice")
    path = events_file(daemon, job_id)
    path.write_text('{"event": "round_started", "round": 1, "total_rounds": 2}\nnot json\n[1]\n')

    first = answer(ask(alice, "watch", job_id=job_id, offset=0))
    with path.open("a") as out:
        out.write('{"event": "round_done", "round": 1, "metrics": {"acc": 0.9}}\n{"event": "task_')
    second = answer(ask(alice, "watch", job_id=job_id, offset=first["offset"]))

    assert first["job"]["job_id"] == job_id and first["job"]["status"] == "SUBMITTED"
    assert first["job"]["waiting"]  # what `status` answers, as it is
    assert first["events"] == [{"event": "round_started", "round": 1, "total_rounds": 2}]
    assert second["events"] == [{"event": "round_done", "round": 1, "metrics": {"acc": 0.9}}]
    assert second["offset"] == path.stat().st_size - len('{"event": "task_')
    assert second["more"] is False


def test_watch_answers_are_bounded_whatever_the_cursor(
    server: Server,  # noqa: F811
    daemon: ServerDaemon,  # noqa: F811
    job_id: str,
) -> None:
    alice = server.admin("alice")
    path = events_file(daemon, job_id)
    events = [{"event": "task_sent", "site": "site-1", "task": "train", "pad": "x" * 200, "n": i} for i in range(3000)]
    path.write_text("".join(json.dumps(event) + "\n" for event in events))  # about 10 FEED_MAX_BYTES

    received, sizes, offset, more = [], [], 0, True
    while more:
        reply = ask(alice, "watch", job_id=job_id, offset=offset)
        body = answer(reply)
        sizes.append(len(bytes(reply.frames[0])))
        received += body["events"]
        offset, more = body["offset"], body["more"]
    past_the_end = answer(ask(alice, "watch", job_id=job_id, offset=1 << 62))

    assert received == events
    assert max(sizes) < FEED_MAX_BYTES + 4096  # the events read, and the record
    assert len(sizes) >= path.stat().st_size // FEED_MAX_BYTES
    assert (past_the_end["events"], past_the_end["offset"]) == ([], path.stat().st_size)


def test_a_bad_cursor_is_refused_with_the_reason(server: Server, job_id: str) -> None:  # noqa: F811
    reply = ask(server.admin("alice"), "watch", job_id=job_id, offset=-5)

    assert not reply.ok
    assert reply.reason == "offset: expected a byte offset from 0 to 2**62, got -5"


def test_watch_is_audited_once_per_watcher_not_once_per_poll(
    server: Server,  # noqa: F811
    daemon: ServerDaemon,  # noqa: F811
    job_id: str,
) -> None:
    alice = server.admin("alice")
    for offset in (0, 10, 20):
        answer(ask(alice, "watch", job_id=job_id, offset=offset))
    answer(ask(alice, "logs", job_id=job_id))
    answer(ask(alice, "logs", job_id=job_id, offset=0))

    assert audited(daemon).count(("alice", "watch", "ok")) == 1
    assert audited(daemon).count(("alice", "logs", "ok")) == 1


def test_a_member_of_another_org_cannot_watch_and_reads_an_unknown_job(
    server: Server,  # noqa: F811
    daemon: ServerDaemon,  # noqa: F811
    job_id: str,
) -> None:
    mia = server.admin("mia")  # a member of org b; the job is alice's, of org a
    made_up = "0123456789ab"

    hidden = ask(mia, "watch", job_id=job_id, offset=0)
    unknown = ask(mia, "watch", job_id=made_up, offset=0)
    followed = ask(mia, "logs", job_id=job_id, offset=0)

    assert (hidden.ok, hidden.reason) == (False, unknown_job(job_id))
    assert unknown.reason == unknown_job(made_up)
    assert (followed.ok, followed.reason) == (False, unknown_job(job_id))
    refusals = [e for e in read(daemon.audit.path) if e["actor"] == "mia" and e.get("job") == job_id]
    assert [e["action"] for e in refusals] == ["watch", "logs"]


def test_logs_with_a_cursor_follow_the_log_and_say_when_the_job_ended(
    server: Server,  # noqa: F811
    daemon: ServerDaemon,  # noqa: F811
    job_id: str,
) -> None:
    alice = server.admin("alice")
    log_file = daemon.store.workspace(job_id) / "server" / "log.txt"
    log_file.parent.mkdir(parents=True)
    log_file.write_text("one\ntwo\n")

    first = answer(ask(alice, "logs", job_id=job_id))
    with log_file.open("a") as out:
        out.write("three\n")
    daemon.store.update(job_id, status="FINISHED_ABORTED", reason="abort command")
    second = answer(ask(alice, "logs", job_id=job_id, offset=first["offset"]))

    assert (first["lines"], first["ended"], first["status"]) == (["one", "two"], False, "SUBMITTED")
    assert (second["lines"], second["ended"]) == (["three"], True)
    assert (second["status"], second["reason"]) == ("FINISHED_ABORTED", "abort command")


def test_logs_follow_reads_at_most_feed_max_bytes_per_answer(
    server: Server,  # noqa: F811
    daemon: ServerDaemon,  # noqa: F811
    job_id: str,
) -> None:
    alice = server.admin("alice")
    log_file = daemon.store.workspace(job_id) / "server" / "log.txt"
    log_file.parent.mkdir(parents=True)
    log_file.write_text("x" * (3 * FEED_MAX_BYTES) + "\n")

    reply = answer(ask(alice, "logs", job_id=job_id, offset=0))

    assert [len(line) for line in reply["lines"]] == [FEED_MAX_BYTES]
    assert (reply["offset"], reply["more"]) == (FEED_MAX_BYTES, True)
