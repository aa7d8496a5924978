"""`StallWatch` and the registry's ``never_pulled``: the sites that leave their task data unpulled."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.stalls import StallWatch
from engine.streaming.downloadable import TensorDownloadable
from engine.streaming.transactions import DownloadRegistry

SITES = {"site-1", "site-2", "site-3"}


def test_a_site_is_stalled_after_three_tasks_in_a_row() -> None:
    watch = StallWatch()

    became = [watch.judged((f"ref-{i}",), SITES, {"site-2"}) for i in range(4)]

    assert became == [[], [], ["site-2"], []]
    assert watch.stalled() == ["site-2"]


def test_a_task_counts_once_and_pulling_again_clears_the_count() -> None:
    watch = StallWatch(stalled_after=2)

    watch.judged(("a", "b"), SITES, {"site-3"})
    assert watch.judged(("b", "a"), SITES, {"site-3"}) == []  # another result of the same task
    watch.judged(("c",), SITES, set())  # site-3 pulled this one
    watch.judged(("d",), SITES, {"site-3"})

    assert watch.stalled() == []


def test_stalled_after_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="stalled_after: expected an integer >= 1, got 0"):
        StallWatch(stalled_after=0)


def test_never_pulled_names_the_receivers_that_asked_for_nothing() -> None:
    registry = DownloadRegistry()
    ref = registry.add(
        TensorDownloadable({"w": torch.arange(1000.0)}, chunk_bytes=1024), ["site-1", "site-2", "site-3"], 60.0
    )

    registry.chunk(ref, "site-1", 0)  # started
    registry.finish(ref, "site-3")  # done without a request counted here

    assert registry.never_pulled([ref]) == {"site-2"}
    registry.finish(ref, "site-1")
    registry.finish(ref, "site-2")  # the server dropped it as a receiver: the offer ends
    assert registry.never_pulled([ref]) == set() and len(registry) == 0
