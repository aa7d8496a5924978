"""The site notices a job's server process reads on its stdin (from the simulator's launcher or the
server daemon): exits and revocations are passed on; anything else is skipped, never raised."""

from __future__ import annotations

import io

import pytest

from engine.runtime.entry import MAX_NOTICE_BYTES, read_site_notices


def _read(data: bytes) -> list[tuple]:
    seen: list[tuple] = []
    read_site_notices(
        io.BytesIO(data),
        lambda site, code: seen.append(("exited", site, code)),
        lambda site: seen.append(("revoked", site)),
    )
    return seen


def test_exits_and_revocations_are_passed_on_in_order() -> None:
    data = b'{"exited": "site-3", "code": -9}\n{"revoked": "site-2"}\n{"exited": "lab-a"}\n'

    assert _read(data) == [("exited", "site-3", -9), ("revoked", "site-2"), ("exited", "lab-a", None)]


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b"[1, 2]\n",
        b'"revoked"\n',
        b"7\n",
        b'{"exited": 3}\n',
        b'{"exited": "site-1", "code": "9"}\n',
        b'{"exited": "site-1", "code": true}\n',
        b'{"revoked": ["site-1"]}\n',
        b'{"other": "site-1"}\n',
        b'{"exited": "' + b"x" * MAX_NOTICE_BYTES + b'"}\n',
    ],
    ids=[
        "not-json",
        "list",
        "string",
        "number",
        "site-not-string",
        "code-string",
        "code-bool",
        "revoked-list",
        "no-key",
        "too-long",
    ],
)
def test_a_line_that_is_not_a_notice_is_skipped_and_the_next_one_read(line: bytes) -> None:
    assert _read(line + b'{"exited": "site-2", "code": 1}\n') == [("exited", "site-2", 1)]
