"""`FileFollower`: the new complete lines of files other processes append to."""

from __future__ import annotations

from pathlib import Path

from engine.runtime.follow import LOG_LINE_EVENT, MAX_LINE_BYTES, FileFollower, follow_run


def follower_of(path: Path) -> tuple[FileFollower, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    follower = FileFollower(lambda key, line: seen.append((key, line)))
    follower.follow("log:site-1", path)
    return follower, seen


def test_complete_lines_only_each_once(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    follower, seen = follower_of(path)
    follower.poll()  # no file yet: nothing, no error
    path.write_bytes(b"first\nsec")

    follower.poll()
    with path.open("ab") as out:
        out.write(b"ond\r\nthird\n")
    follower.poll()
    follower.poll()

    assert seen == [("log:site-1", "first"), ("log:site-1", "second"), ("log:site-1", "third")]


def test_a_line_too_long_is_cut_and_the_next_one_is_whole(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    follower, seen = follower_of(path)
    path.write_bytes(b"x" * (MAX_LINE_BYTES + 10))
    follower.poll()
    with path.open("ab") as out:
        out.write(b"y" * 5 + b"\nnext\n")

    follower.poll()

    assert [len(line) for _, line in seen] == [MAX_LINE_BYTES, 4]
    assert seen[-1][1] == "next"


def test_stop_reads_what_is_left(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    follower, seen = follower_of(path)
    follower.start()
    path.write_text("written before the end\n", encoding="utf-8")

    follower.stop()

    assert seen[-1] == ("log:site-1", "written before the end")
    assert len(seen) == 1


def test_follow_run_hands_over_a_clients_own_steps_and_the_logs(tmp_path: Path) -> None:
    for site in ("server", "site-1"):
        (tmp_path / site).mkdir()
    (tmp_path / "site-1" / "events.jsonl").write_text(
        '{"event": "task_received", "site": "site-2", "task": "train"}\n'  # a client speaks for itself only
        '{"event": "round_done", "round": 1}\n'  # not a client's step: the server says it
        "not json\n",
        encoding="utf-8",
    )
    (tmp_path / "server" / "log.txt").write_text("2026 DEBUG x: hello\n", encoding="utf-8")
    seen: list[dict] = []

    follower = follow_run(tmp_path, ["site-1"], seen.append, events=True, logs=True)
    assert follower is not None
    follower.stop()

    assert sorted(seen, key=str) == sorted(
        [
            {"event": "task_received", "site": "site-1", "task": "train"},
            {"event": LOG_LINE_EVENT, "site": "server", "text": "2026 DEBUG x: hello"},
        ],
        key=str,
    )
    assert follow_run(tmp_path, ["site-1"], seen.append, events=False, logs=False) is None
