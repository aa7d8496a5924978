"""A site whose result spoils the round's sum (fails after part of it was folded) round after round
is received whole from then on: otherwise it would make the server pull every other result twice
each round, as a rebuild does."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from engine.aggregators.folding import WHOLE_AFTER_SPOILED, FoldingModelAggregator
from engine.workflows.round_folding import FoldedResults
from tests.unit.aggregators.test_folding import _header, _held_stream, _layout, _result


class Loop(FoldedResults):
    """The state of `RoundLoop` that `FoldedResults._rebuild` reads and writes."""

    def __init__(self) -> None:
        self._whole_from: set[str] = set()
        self._spoiled: dict[str, int] = {}
        self.refused: set[str] = set()
        self.failures: dict[str, str] = {}
        self.abort_signal = threading.Event()
        self.events: list[tuple[str, dict]] = []
        self.context = SimpleNamespace(report=lambda event, **fields: self.events.append((event, fields)))


def spoiled_round(loop: Loop, current_round: int, spoiler: str) -> None:
    """A round of site-1 and site-3 in full, and ``spoiler`` failing midway; the sum then rebuilt."""
    log: list = []
    aggregator = FoldingModelAggregator()
    _held_stream(aggregator, "site-1", _result(1), 2, log)
    spoiling = aggregator.open_result(_header(9), spoiler)
    spoiling.check_layout(_layout(_result(2)))
    spoiling.fold("w", _result(2)["w"])
    _held_stream(aggregator, "site-3", _result(3), 5, log)
    spoiling.fail(f"{spoiler} stopped serving its result")
    aggregator.close()
    accepted = ["site-1", "site-3"]
    loop._rebuild(aggregator, accepted, current_round)
    assert accepted == ["site-1", "site-3"] and aggregator.tainted() == {}


def test_a_site_that_spoils_the_sum_in_two_rounds_is_received_whole_after() -> None:
    loop = Loop()
    for current_round in range(WHOLE_AFTER_SPOILED):
        assert "site-2" not in loop._whole_from  # once could be a crash: it is still folded
        spoiled_round(loop, current_round, "site-2")

    assert loop._whole_from == {"site-2"}
    assert [event for event, _ in loop.events] == ["round_rebuilt"] * WHOLE_AFTER_SPOILED


def test_a_site_refused_by_the_checks_midway_is_received_whole_at_once() -> None:
    loop = Loop()
    loop.refused.add("site-2")

    spoiled_round(loop, 0, "site-2")

    assert loop._whole_from == {"site-2"}
