"""LogLimiter: a peer that sends a flood of refused messages writes a bounded number of log lines."""

from __future__ import annotations

import logging
import time

import pytest

from engine.cells.log_limit import LogLimiter

log = logging.getLogger("test.log_limit")


def test_a_flood_writes_burst_lines_per_window_then_says_how_many_it_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limiter = LogLimiter(burst=3, interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="test.log_limit"):
        written = [limiter.warning(log, "message refused: from=%s", f"site-{i}") for i in range(1000)]
        other = limiter.warning(log, "peer refused: fqcn=%s", "site-9")  # another kind keeps its own budget
        time.sleep(0.25)
        limiter.warning(log, "message refused: from=%s", "site-x")

    assert written[:3] == [True] * 3 and not any(written[3:]) and other
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "message refused: from=site-0",
        "message refused: from=site-1",
        "message refused: from=site-2",
        "peer refused: fqcn=site-9",
        "message refused: from=site-x (and 997 more like it in the last 0.2 s, not logged)",
    ]


def test_reset_gives_every_kind_its_budget_back(caplog: pytest.LogCaptureFixture) -> None:
    limiter = LogLimiter(burst=1, interval_s=60)
    limiter.warning(log, "refused: %s", "a")
    assert not limiter.warning(log, "refused: %s", "b")

    limiter.reset()

    assert limiter.warning(log, "refused: %s", "c")
