"""The admin console's text output: peer text cannot act on the admin's terminal."""

from __future__ import annotations

import pytest

from engine.deploy.console import _print_text, printable


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("round 1 done", "round 1 done"),
        ("\x1b[2J\x1b]0;pwned\x07cleared", "\\x1b[2J\\x1b]0;pwned\\x07cleared"),
        ("ok\rforged line\nnext", "ok\\x0dforged line\\x0anext"),
        ("evil\u202etxt.exe", "evil\\u202etxt.exe"),
        ("\x9b31m C1 escape", "\\x9b31m C1 escape"),
        ("tab\tand ünïcode", "tab\tand ünïcode"),
    ],
    ids=["plain", "escape-sequences", "line-breaks", "bidi-override", "c1-control", "tab-and-letters"],
)
def test_printable_escapes_what_a_terminal_would_act_on(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_log_lines_from_a_site_reach_the_terminal_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    _print_text("logs", {"lines": ["\x1b[31mred", "plain"]})

    assert capsys.readouterr().out == "\\x1b[31mred\nplain\n"


def test_a_job_name_and_reason_reach_the_terminal_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    _print_text("status", {"job_id": "3f9c0a1b2c4d", "name": "x\x1b[2J", "reason": "site-1: \x1b]52;c;aGk=\x07"})

    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert out.splitlines() == [
        "job_id          3f9c0a1b2c4d",
        "name            x\\x1b[2J",
        "reason          site-1: \\x1b]52;c;aGk=\\x07",
    ]


def test_delete_says_which_job_went(capsys: pytest.CaptureFixture[str]) -> None:
    _print_text("delete", {"job_id": "3f9c0a1b2c4d", "deleted": True})

    assert capsys.readouterr().out == "deleted: 3f9c0a1b2c4d\n"


def test_status_prints_lists_as_text_not_as_python(capsys: pytest.CaptureFixture[str]) -> None:
    _print_text("status", {"job_id": "3f9c0a1b2c4d", "sites": ["site-1", "site-2"], "results_pending": ["site-2"]})

    assert capsys.readouterr().out.splitlines() == [
        "job_id          3f9c0a1b2c4d",
        "sites           site-1, site-2",
        "results_pending site-2",
    ]


def test_list_and_clients_have_a_header(capsys: pytest.CaptureFixture[str]) -> None:
    job = {"job_id": "3f9c0a1b2c4d", "status": "RUNNING", "name": "fedavg", "submitter": "alice", "submitted_at": "t"}
    site = {"site": "site-1", "org": "lab", "connected": False, "last_status_s": None, "jobs": []}

    _print_text("list", [job])
    _print_text("clients", [site])

    assert capsys.readouterr().out.splitlines() == [
        "job id        status                       name             submitter    submitted at",
        "3f9c0a1b2c4d  RUNNING                      fedavg           alice        t",
        "site         org              state                              jobs",
        "site-1       lab              not connected                      -",
    ]


@pytest.mark.parametrize(
    ("target", "shown"),
    [
        ("server", "shutting down: the server"),
        ("all", "shutting down: every connected site, then the server"),
        ("site-1", "shutting down: site-1"),
    ],
    ids=["server", "all", "site"],
)
def test_shutdown_prints_text_in_text_mode(target: str, shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    _print_text("shutdown", {"shutdown": target})

    assert capsys.readouterr().out == f"{shown}\n"
