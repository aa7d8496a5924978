"""The audit log: whole JSON lines appended, durable, private, and safe from what peers send."""

from __future__ import annotations

import datetime
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.deploy.audit import MAX_VALUE_CHARS, AuditLog, clip, read
from engine.errors import SecurityError


@pytest.fixture
def audit(tmp_path: Path) -> Iterator[AuditLog]:
    log = AuditLog(tmp_path / "audit.log")
    yield log
    log.close()


def test_records_are_appended_and_read_back(audit: AuditLog) -> None:
    audit.record("carol", "submit", "ok", job="7f3a")
    audit.record("site-1", "job_deployed", "refused", job="7f3a", reason="no custom code")

    records = read(audit.path)

    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {"actor": "carol", "action": "submit", "outcome": "ok", "job": "7f3a"},
        {"actor": "site-1", "action": "job_deployed", "outcome": "refused", "job": "7f3a", "reason": "no custom code"},
    ]
    assert list(records[0])[:4] == ["time", "actor", "action", "outcome"]


def test_the_time_is_iso_8601_utc(audit: AuditLog) -> None:
    before = datetime.datetime.now(datetime.timezone.utc)
    audit.record("carol", "list", "ok")

    written = read(audit.path)[0]["time"]

    assert written.endswith("Z")
    moment = datetime.datetime.fromisoformat(written.replace("Z", "+00:00"))
    assert moment.utcoffset() == datetime.timedelta(0)
    assert abs(moment - before) < datetime.timedelta(seconds=5)


def test_a_reopened_log_is_appended_to(tmp_path: Path) -> None:
    with AuditLog(tmp_path / "audit.log") as first:
        first.record("server", "job_started", "ok", job="1")
    with AuditLog(tmp_path / "audit.log") as second:
        second.record("server", "job_ended", "ok", job="1")

    assert [r["action"] for r in read(tmp_path / "audit.log")] == ["job_started", "job_ended"]


@pytest.mark.parametrize(
    "value",
    [
        'x"}\n{"time":"forged","actor":"alice","action":"shutdown","outcome":"ok"}',
        "line\rcarriage\u2028separator\u2029paragraph\x85next",
        "\x1b[2J\x1b[31mterminal escape",
    ],
    ids=["newline-and-forged-record", "other-line-breaks", "terminal-escape"],
)
def test_a_value_from_a_peer_stays_inside_one_line(audit: AuditLog, value: str) -> None:
    audit.record(value, "abort", "refused", reason=value)

    raw = audit.path.read_bytes()

    assert raw.count(b"\n") == 1 and raw.endswith(b"\n")
    assert raw.isascii() and b"\x1b" not in raw and b"\r" not in raw
    assert [(r["actor"], r["reason"]) for r in read(audit.path)] == [(value, value)]


def test_the_file_is_created_private(audit: AuditLog) -> None:
    assert stat.S_IMODE(audit.path.stat().st_mode) == 0o600


def test_an_existing_file_open_to_others_is_made_private(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    path.write_text("")
    path.chmod(0o644)

    AuditLog(path).close()

    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "audit.log").symlink_to(tmp_path / "elsewhere")

    with pytest.raises(
        SecurityError, match=r"audit.log: cannot open the audit log for appending: it is a symbolic link$"
    ):
        AuditLog(tmp_path / "audit.log")


def test_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match=r": cannot open the audit log for appending: Is a directory$"):
        AuditLog(tmp_path)


def test_concurrent_writers_write_whole_lines_only(audit: AuditLog) -> None:
    threads, per_thread = 8, 50
    long_reason = "r" * 5000  # longer than a pipe buffer, so a line is never written in one piece by luck
    start = threading.Barrier(threads)

    def write(writer: int) -> None:
        start.wait(timeout=10)
        for n in range(per_thread):
            audit.record(f"admin-{writer}", "status", "ok", n=n, reason=long_reason)

    workers = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)

    lines = audit.path.read_bytes().split(b"\n")
    records = read(audit.path)
    assert lines[-1] == b"" and len(lines) - 1 == threads * per_thread
    assert len(records) == threads * per_thread
    for writer in range(threads):
        assert [r["n"] for r in records if r["actor"] == f"admin-{writer}"] == list(range(per_thread))


def test_two_logs_on_one_file_append_whole_lines(tmp_path: Path) -> None:
    with AuditLog(tmp_path / "audit.log") as server, AuditLog(tmp_path / "audit.log") as job_process:
        for n in range(20):
            server.record("server", "heartbeat", "ok", n=n)
            job_process.record("job", "round", "ok", n=n)

    assert len(read(tmp_path / "audit.log")) == 40


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "audit.log"
    with AuditLog(path) as audit:
        audit.record("carol", "submit", "ok", job="1")
    with path.open("ab") as file:
        file.write(b'{"time":"2025-01-31T12:00:00.000Z","actor":"ca')

    with caplog.at_level(logging.WARNING, logger="engine.deploy.audit"):
        records = read(path)

    assert [r["job"] for r in records] == ["1"]
    assert f"torn last line of audit log skipped: file={path} line=2" in caplog.messages


def test_appending_after_a_torn_line_ends_it_first(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "audit.log"
    path.write_bytes(b'{"time":"2025-01-31T12:00:00.000Z","actor":"carol","action":"submit","outcome":"ok"}\n{"ti')
    os.chmod(path, 0o600)

    with caplog.at_level(logging.WARNING, logger="engine.deploy.audit"), AuditLog(path) as audit:
        audit.record("alice", "list", "ok")
    records = read(path)

    assert [r["actor"] for r in records] == ["carol", "alice"]
    assert f"audit log line skipped, not a JSON record: file={path} line=2" in caplog.messages


def test_reserved_keys_are_refused_as_details(audit: AuditLog) -> None:
    with pytest.raises(ValueError, match=r"audit detail keys \['time'\] are reserved"):
        audit.record("carol", "submit", "ok", time="yesterday")


def test_a_value_json_cannot_encode_is_written_as_text(audit: AuditLog) -> None:
    audit.record("server", "download", "ok", folder=Path("/results/7f3a"))

    assert read(audit.path)[0]["folder"] == "/results/7f3a"


def test_a_closed_log_refuses_records(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.log")
    audit.close()
    audit.close()

    with pytest.raises(ValueError, match="the audit log is closed"):
        audit.record("carol", "list", "ok")


def test_every_string_is_clipped_so_a_peer_cannot_flood_the_log(audit: AuditLog) -> None:
    huge = "x" * (1 << 20)

    audit.record(huge, huge, "refused", reason=huge, sites=["site-1", huge], code=3, error=ValueError(huge))

    written = read(audit.path)[0]
    clipped = "x" * MAX_VALUE_CHARS + "..."
    assert (written["actor"], written["action"], written["reason"], written["error"]) == (clipped,) * 4
    assert written["sites"] == ["site-1", clipped] and written["code"] == 3
    assert audit.path.stat().st_size < 2000


@pytest.mark.parametrize(
    ("text", "clipped"),
    [("short", "short"), ("y" * MAX_VALUE_CHARS, "y" * MAX_VALUE_CHARS), ("z" * 201, "z" * 200 + "..."), (7, "7")],
    ids=["short", "at-the-limit", "over-the-limit", "not-a-string"],
)
def test_clip(text: object, clipped: str) -> None:
    assert clip(text) == clipped
