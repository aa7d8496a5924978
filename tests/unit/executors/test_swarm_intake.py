"""A Swarm aggregation client folds its trainers' results chunk by chunk (`ResultIntake`).

Real cells over TCP loopback (a server cell routing three sites), real download services and
codecs, 4 KiB chunks: the mean must be the whole-result path's (DXOAggregator) and an independent
float64 computation's, to 1e-6; a refused result is refused before any chunk is pulled and leaves
the sum untouched; a result that fails after some of its chunks were folded is never in the mean
(the sum is rebuilt from the others, pulled once more), and the trainers' held results are freed
once the round is over.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine import fobs
from engine.aggregators import DXOAggregator, ResultRules, folding
from engine.cells import Cell, CellSettings, Message
from engine.errors import WorkflowError
from engine.executors.ccwf.gathering import LOST, RoundGathering
from engine.executors.ccwf.swarm_intake import HELD_KEY, ResultIntake, RoundFold
from engine.model import DXO, DataKind, ReturnCode, Shareable, register_model_types
from engine.model.ccwf import CCWF_CHANNEL
from engine.streaming.codec import MessageCodec
from engine.streaming.service import CHANNEL, TOPIC_CHUNK, DownloadService
from engine.streaming.via_downloader import StreamingContext

SITES = ["site-1", "site-2", "site-3"]  # site-1 aggregates (and trains)
CHUNK_BYTES = 4096
TOPIC = "swarm_result"
WEIGHTS = {"site-2": 0.5}  # aggregation_weights: site-2's results count half


def base_params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {  # streamed in this order: "c" (float64) last
        "n": torch.tensor(7, dtype=torch.int64),
        "b": torch.rand(40, generator=generator),
        "a": torch.rand(64, 40, generator=generator),  # 10 KiB: three chunks
        "c": torch.rand(16, 16, generator=generator, dtype=torch.float64),
    }


def trained(site: str) -> dict[str, torch.Tensor]:
    k = int(site[-1])
    generator = torch.Generator().manual_seed(10 + k)
    return {
        name: value + k if not value.is_floating_point() else value + torch.randn(value.shape, generator=generator)
        for name, value in base_params().items()
    }


def result(site: str, *, params: dict[str, torch.Tensor] | None = None, steps: float | None = None, **kw) -> Shareable:
    k = int(site[-1])
    meta = {"NUM_STEPS_CURRENT_ROUND": steps if steps is not None else k * 100, "metrics": {"loss": float(k)}}
    shareable = DXO(kw.get("kind", DataKind.WEIGHTS), params if params is not None else trained(site), meta)
    shareable = shareable.to_shareable()
    shareable.set_return_code(ReturnCode.OK)
    shareable.set_header("current_round", kw.get("current_round", 0))
    return shareable


def weight(site: str) -> float:
    return WEIGHTS.get(site, 1.0) * int(site[-1]) * 100


def independent_mean(sites: list[str]) -> dict[str, torch.Tensor]:
    """The weighted mean in float64, computed here (an integer's is rounded)."""
    total = sum(weight(site) for site in sites)
    mean = {name: sum(weight(site) * trained(site)[name].double() for site in sites) / total for name in base_params()}
    mean["n"] = mean["n"].round()
    return mean


def whole_path_mean(sites: list[str]) -> dict[str, torch.Tensor]:
    """Today's path: each result whole into the DXOAggregator."""
    aggregator = DXOAggregator(aggregation_weights=WEIGHTS, expected_data_kind="WEIGHTS")
    for site in sites:
        assert aggregator.accept(result(site), site, 0)
    return DXO.from_shareable(aggregator.aggregate(0)).data


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name].dtype == base_params()[name].dtype, name
        assert torch.allclose(actual[name].double(), value.double(), rtol=0, atol=1e-6), name


@dataclass
class Swarm:
    cells: dict[str, Cell]
    services: dict[str, DownloadService]
    codecs: dict[str, MessageCodec]
    intake: ResultIntake
    offers: dict[str, list[str]]

    def round(self, number: int = 0) -> RoundGathering:
        entry = self.intake.round(number, lambda _entry: None)
        entry.set_base(DXO(DataKind.WEIGHTS, base_params()).to_shareable())
        return entry

    def send(self, site: str, shareable: Shareable, number: int = 0) -> Message:
        """``site`` offers its result of round ``number`` to site-1 (as a trainer's `_submit` does)."""
        offers = self.offers.setdefault(site, [])
        frames = self.codecs[site].encode(shareable, receivers=["site-1"], offers=offers)
        return self.cells[site].request("site-1", CCWF_CHANNEL, TOPIC, {"round": number, "ok": True}, frames, 10)

    def served(self, site: str) -> int:
        return self.services[site].chunks_served

    def open_offers(self, site: str) -> int:
        return len(self.services[site].registry)


def wait_answered(entry: RoundGathering, sites: list[str], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(site in entry.accepted or site in entry.failed for site in sites):
        assert time.monotonic() < deadline, (entry.accepted, entry.failed)
        time.sleep(0.01)


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    settings = CellSettings(port=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    server = Cell("server", settings).start()
    cells, services, codecs = {}, {}, {}
    registry = fobs.new_registry()
    register_model_types(registry)
    try:
        for site in SITES:
            cells[site] = Cell(site, settings, connect_to=server.endpoint).start()
            assert cells[site].wait_connected(timeout_s=10)
            services[site] = DownloadService(cells[site], sweep_interval_s=0.2)
            context = StreamingContext(cells[site], services[site], CHUNK_BYTES, CHUNK_BYTES, per_request_timeout_s=10)
            codecs[site] = MessageCodec(registry, context)
        aggregator = DXOAggregator(aggregation_weights=WEIGHTS, expected_data_kind="WEIGHTS")
        intake = ResultIntake(codecs["site-1"], aggregator, ResultRules(), SITES, 1, False, "site-1")
        cells["site-1"].register_handler(CCWF_CHANNEL, TOPIC, lambda m: intake.on_result(m, m.source))
        yield Swarm(cells, services, codecs, intake, {})
        intake.shutdown()
    finally:
        for service in services.values():
            service.close()
        for cell in [*cells.values(), server]:
            cell.stop(timeout_s=3)


def aggregate(swarm: Swarm, entry: RoundGathering, minimum: int) -> dict[str, torch.Tensor]:
    swarm.intake.close(entry, minimum, "test")
    data = DXO.from_shareable(swarm.intake.aggregator_of(entry).aggregate(0)).data
    swarm.intake.end(entry)
    return data


def test_results_are_folded_chunk_by_chunk_all_at_once_into_the_same_mean(swarm: Swarm) -> None:
    entry = swarm.round()

    swarm.intake.take_own(entry, "site-1", result("site-1"))
    replies = [swarm.send(site, result(site)) for site in ("site-2", "site-3")]
    wait_answered(entry, SITES)
    held_before_the_end = [swarm.open_offers(site) for site in ("site-2", "site-3")]
    mean = aggregate(swarm, entry, 3)

    assert all(reply.header[HELD_KEY] is True for reply in replies)  # the trainers keep serving them
    assert entry.failed == {} and sorted(entry.accepted) == SITES
    assert sorted(entry.fold.folded) == SITES  # chunk by chunk (site-1's own: tensor by tensor)
    assert swarm.served("site-2") >= 4 and swarm.served("site-3") >= 4  # 10 KiB "a": three chunks at least
    assert_close(mean, independent_mean(SITES))
    assert_close(mean, whole_path_mean(SITES))
    assert held_before_the_end == [1, 1]  # held until the round's mean is made...
    deadline = time.monotonic() + 5
    while swarm.open_offers("site-2") + swarm.open_offers("site-3") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert swarm.open_offers("site-2") == swarm.open_offers("site-3") == 0  # ...then the trainers free them


def test_whole_results_wait_for_each_other_but_folded_ones_are_pulled_at_once(swarm: Swarm) -> None:
    pulling = swarm.intake._pulls  # noqa: SLF001 - the pool's size is the point

    assert swarm.intake.folds and pulling._max_workers == len(SITES)  # noqa: SLF001
    unfolded = ResultIntake(
        swarm.codecs["site-1"], DXOAggregator(exclude_vars="b"), ResultRules(), SITES, 1, False, "x"
    )
    assert not unfolded.folds and unfolded._pulls._max_workers == 1  # noqa: SLF001
    unfolded.shutdown()


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"current_round": 5}, "result of round 6"),
        ({"kind": DataKind.WEIGHT_DIFF}, "data kind is WEIGHT_DIFF"),
        ({"steps": 1e9}, "max_local_steps"),
        ({"params": {**trained("site-3"), "a": torch.zeros(64, 41)}}, "'a': shape (64, 41), expected (64, 40)"),
        (
            {"params": {**trained("site-3"), "a": torch.zeros(64, 40, dtype=torch.float64)}},
            "'a': dtype float64, expected float32",
        ),
        ({"params": {**trained("site-3"), "z": torch.zeros(3)}}, "unexpected 'z'"),
    ],
    ids=["round", "kind", "weight", "shape", "dtype", "name"],
)
def test_a_refused_result_is_refused_before_any_chunk_and_the_sum_is_untouched(
    swarm: Swarm, bad: dict, reason: str
) -> None:
    entry = swarm.round()

    swarm.intake.take_own(entry, "site-1", result("site-1"))
    swarm.send("site-2", result("site-2"))
    swarm.send("site-3", result("site-3", **bad))
    wait_answered(entry, SITES)

    assert list(entry.failed) == ["site-3"] and reason in entry.failed["site-3"], entry.failed
    assert swarm.served("site-3") == 0  # not one chunk pulled
    assert entry.fold.sums.tainted() == {}
    deadline = time.monotonic() + 5  # and its trainer was told to free it, not left to hold it
    while swarm.open_offers("site-3") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert swarm.open_offers("site-3") == 0
    mean = aggregate(swarm, entry, 2)
    assert_close(mean, independent_mean(["site-1", "site-2"]))


def test_a_result_failing_after_some_chunks_were_folded_is_never_in_the_mean(swarm: Swarm) -> None:
    entry = swarm.round()
    poisoned = trained("site-3")
    poisoned["c"].view(-1)[-1] = float("nan")  # the stream's last element: all else is folded first

    swarm.intake.take_own(entry, "site-1", result("site-1"))
    swarm.send("site-2", result("site-2"))
    swarm.send("site-3", result("site-3", params=poisoned))
    wait_answered(entry, SITES)
    served_once = swarm.served("site-2")

    assert "NaN or infinite values in 'c'" in entry.failed["site-3"]
    assert entry.fold.sums.tainted().keys() == {"site-3"}  # parts of site-3 are in the sum
    mean = aggregate(swarm, entry, 2)
    assert sorted(entry.accepted) == ["site-1", "site-2"]
    assert swarm.served("site-2") == 2 * served_once  # pulled once more into the rebuilt sum
    assert_close(mean, independent_mean(["site-1", "site-2"]))
    assert_close(mean, whole_path_mean(["site-1", "site-2"]))

    # The next round takes site-3's result whole: refused before anything of it is added.
    following = swarm.round(1)
    swarm.intake.take_own(following, "site-1", result("site-1", current_round=1))
    swarm.send("site-2", result("site-2", current_round=1), number=1)
    swarm.send("site-3", result("site-3", params=poisoned, current_round=1), number=1)
    wait_answered(following, SITES)

    assert "NaN or infinite values in 'c'" in following.failed["site-3"]
    assert following.fold.sums.tainted() == {}  # no rebuild this time
    assert_close(aggregate(swarm, following, 2), independent_mean(["site-1", "site-2"]))


def test_a_result_that_cannot_be_pulled_again_is_left_out_of_the_rebuilt_sum(swarm: Swarm) -> None:
    entry = swarm.round()
    poisoned = trained("site-3")
    poisoned["c"].view(-1)[-1] = float("inf")

    swarm.intake.take_own(entry, "site-1", result("site-1"))
    swarm.send("site-2", result("site-2"))
    swarm.send("site-3", result("site-3", params=poisoned))
    wait_answered(entry, SITES)
    swarm.services["site-2"].drop(swarm.offers["site-2"])  # site-2 stopped serving it

    mean = aggregate(swarm, entry, 1)

    assert entry.accepted == ["site-1"]
    assert "could not be pulled again" in entry.failed["site-2"]
    assert_close(mean, independent_mean(["site-1"]))


def test_a_round_too_short_of_results_fails_without_pulling_anything_again(swarm: Swarm) -> None:
    entry = swarm.round()
    poisoned = trained("site-3")
    poisoned["c"].view(-1)[-1] = float("nan")

    swarm.intake.take_own(entry, "site-1", result("site-1"))
    swarm.send("site-2", result("site-2"))
    swarm.send("site-3", result("site-3", params=poisoned))
    wait_answered(entry, SITES)
    served = swarm.served("site-2")

    with pytest.raises(
        WorkflowError, match=r"2 usable results of 3 \(min_responses_required=3, test\); failed: site-3"
    ):
        swarm.intake.close(entry, 3, "test")
    swarm.intake.end(entry)
    assert swarm.served("site-2") == served
    deadline = time.monotonic() + 5
    while swarm.open_offers("site-2") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert swarm.open_offers("site-2") == 0  # the round is over: site-2 may free its result


def test_a_result_sent_before_the_rounds_model_waits_for_it_then_is_folded(swarm: Swarm) -> None:
    """Nothing of it is pulled before the model is here: it is checked against it (and sized by it)."""
    entry = swarm.intake.round(0, lambda _entry: None)  # no base yet

    swarm.send("site-2", result("site-2"))
    time.sleep(0.5)
    assert "site-2" not in entry.accepted and swarm.services["site-2"].bytes_served() == {}
    entry.set_base(DXO(DataKind.WEIGHTS, base_params()).to_shareable())
    wait_answered(entry, ["site-2"])
    swarm.intake.take_own(entry, "site-1", result("site-1"))
    swarm.send("site-3", result("site-3"))
    wait_answered(entry, SITES)

    assert sorted(entry.fold.folded) == SITES
    assert_close(aggregate(swarm, entry, 3), independent_mean(SITES))


def test_a_result_announcing_more_than_twice_the_rounds_model_is_refused_before_it_is_pulled(swarm: Swarm) -> None:
    entry = swarm.round()
    padded = DXO.from_shareable(result("site-3"))
    padded.meta["junk"] = np.ones(8 << 20, dtype=np.float32)  # 32 MiB beside a model of a few KiB
    shareable = padded.to_shareable()
    shareable.set_header("current_round", 0)
    shareable.set_return_code(ReturnCode.OK)

    swarm.send("site-3", shareable)
    wait_answered(entry, ["site-3"])

    assert "more than a result of site-3" in entry.failed["site-3"]
    assert sum(swarm.services["site-3"].bytes_served().values()) == 0


def inline_codec(swarm: Swarm, site: str) -> MessageCodec:
    """``site``'s codec with a chunk size of 0: its tensors travel in the message, so they are taken whole."""
    registry = fobs.new_registry()
    register_model_types(registry)
    return MessageCodec(registry, StreamingContext(swarm.cells[site], swarm.services[site], 0, 0))


@pytest.mark.parametrize(
    ("changed", "why"),
    [
        ({"a": torch.zeros(3), "evil": np.zeros(5, dtype=np.float32)}, "unexpected 'evil'; 'a': shape \\(3,\\)"),
        ({"a": torch.zeros(64, 40, dtype=torch.int64)}, "'a': dtype int64, expected float32"),
    ],
    ids=["names-and-shapes", "dtype"],
)
def test_a_result_taken_whole_is_checked_against_the_rounds_model(swarm: Swarm, changed: dict, why: str) -> None:
    """A trainer that sends its values inline (or as arrays) cannot skip the check the chunk-by-chunk
    path makes before its first chunk: sent first, it would otherwise set the sums' layout."""
    entry = swarm.round()
    frames = inline_codec(swarm, "site-3").encode(
        result("site-3", params={**trained("site-3"), **changed}, steps=1), receivers=["site-1"]
    )
    swarm.cells["site-3"].request("site-1", CCWF_CHANNEL, TOPIC, {"round": 0, "ok": True}, frames, 10)
    wait_answered(entry, ["site-3"])
    swarm.intake.take_own(entry, "site-1", result("site-1"))
    swarm.send("site-2", result("site-2"))
    wait_answered(entry, SITES)

    assert sorted(entry.accepted) == ["site-1", "site-2"]
    assert re.search(why, entry.failed["site-3"])
    assert_close(aggregate(swarm, entry, 2), independent_mean(["site-1", "site-2"]))


def test_the_round_closed_refuses_results_and_a_late_fold(swarm: Swarm) -> None:
    entry = swarm.round()
    swarm.intake.take_own(entry, "site-1", result("site-1"))
    swarm.intake.close(entry, 1, "test")

    with pytest.raises(Exception, match="round 1 is closed at site-1"):
        swarm.send("site-2", result("site-2"))
    assert swarm.served("site-2") == 0
    mean = DXO.from_shareable(swarm.intake.aggregator_of(entry).aggregate(0)).data
    swarm.intake.end(entry)
    assert_close(mean, independent_mean(["site-1"]))


def hold_chunks_after_the_first(swarm: Swarm, site: str, release: threading.Event) -> threading.Event:
    """``site`` serves the first chunk of its result, then holds every other chunk request (alive, silent)."""
    held = threading.Event()
    service = swarm.services[site]

    def holding(message: Message):  # type: ignore[no-untyped-def]
        if message.header.get("index") != 0:
            held.set()
            release.wait(30)
        return service._on_chunk(message)

    swarm.cells[site].unregister_handler(CHANNEL, TOPIC_CHUNK)
    swarm.cells[site].register_handler(CHANNEL, TOPIC_CHUNK, holding)
    return held


def test_closing_the_round_ends_the_pull_of_a_result_still_coming(swarm: Swarm) -> None:
    """The round's end stops the pull at once (not after the 10 s per-request timeout and its
    retries): the pull thread is free and the sum is rebuilt without the part that came."""
    release = threading.Event()
    held = hold_chunks_after_the_first(swarm, "site-3", release)
    try:
        entry = swarm.round()
        swarm.intake.take_own(entry, "site-1", result("site-1"))
        swarm.send("site-2", result("site-2"))
        swarm.send("site-3", result("site-3"))
        wait_answered(entry, ["site-2"])
        assert held.wait(10)
        closed = time.monotonic()

        mean = aggregate(swarm, entry, 2)
        wait_answered(entry, SITES, timeout_s=2.0)

        assert time.monotonic() - closed < 2.0
        assert re.search("stopped|closed", entry.failed["site-3"])
        assert sorted(entry.accepted) == ["site-1", "site-2"]
        assert_close(mean, independent_mean(["site-1", "site-2"]))
    finally:
        release.set()


def test_shutdown_ends_the_pulls_still_running_at_once(swarm: Swarm) -> None:
    release = threading.Event()
    held = hold_chunks_after_the_first(swarm, "site-3", release)
    try:
        entry = swarm.round()
        swarm.send("site-3", result("site-3"))
        assert held.wait(10)
        stopping = time.monotonic()

        swarm.intake.shutdown()

        assert time.monotonic() - stopping < 2.0
        assert "stopped" in entry.failed["site-3"]
    finally:
        release.set()


def test_a_pull_again_past_its_time_in_a_rebuild_ends_at_once(swarm: Swarm, monkeypatch: pytest.MonkeyPatch) -> None:
    """site-2 answers its first pull, then holds the rebuild's: left out after its time, and its
    pull (a thread, the pending requests) ends then, not after the 10 s per-request timeout."""
    monkeypatch.setattr(folding, "MIN_REBUILD_S", 0.5)
    release = threading.Event()
    entry = swarm.round()
    poisoned = trained("site-3")
    poisoned["c"].view(-1)[-1] = float("nan")
    swarm.intake.take_own(entry, "site-1", result("site-1"))
    swarm.send("site-2", result("site-2"))
    wait_answered(entry, ["site-2"])
    swarm.send("site-3", result("site-3", params=poisoned))
    wait_answered(entry, SITES)
    held = hold_chunks_after_the_first(swarm, "site-2", release)
    try:
        mean = aggregate(swarm, entry, 1)
        assert held.is_set()
        left_out = time.monotonic()
        while any(thread.name == "refold-site-2" for thread in threading.enumerate()):
            assert time.monotonic() - left_out < 2.0, "the pull went on after it was left out"
            time.sleep(0.02)
    finally:
        release.set()

    assert "not in again within 0.5 s" in entry.failed["site-2"]
    assert_close(mean, independent_mean(["site-1"]))


class KeepsTheFirst(DXOAggregator):
    """A custom aggregator built on the weighted one: it may aggregate otherwise, so it is never folded."""


@pytest.mark.parametrize(
    ("aggregator", "folds"),
    [
        (DXOAggregator(expected_data_kind="WEIGHTS"), True),
        (DXOAggregator(expected_data_kind="WEIGHT_DIFF", aggregation_weights={"site-1": 2.0}), True),
        (DXOAggregator(expected_data_kind="WEIGHTS", exclude_vars="bn"), False),
        (DXOAggregator(expected_data_kind="METRICS"), False),
        (KeepsTheFirst(expected_data_kind="WEIGHTS"), False),
    ],
    ids=["weights", "diff", "exclude_vars", "metrics", "subclass"],
)
def test_only_the_default_weighted_mean_is_folded(swarm: Swarm, aggregator: DXOAggregator, folds: bool) -> None:
    intake = ResultIntake(swarm.codecs["site-1"], aggregator, ResultRules(), SITES, 1, False, "x")
    on_disk = ResultIntake(swarm.codecs["site-1"], aggregator, ResultRules(), SITES, 1, True, "y")

    assert intake.folds is folds and on_disk.folds is False
    assert isinstance(intake.round(0, lambda _entry: None).fold, RoundFold) is folds
    intake.shutdown()
    on_disk.shutdown()


def test_an_abandoned_round_is_made_anew_and_its_old_gathering_ending_late_forgets_only_itself(swarm: Swarm) -> None:
    intake = ResultIntake(swarm.codecs["site-1"], DXOAggregator(), ResultRules(), SITES, 1, False, "x")
    old = intake.round(2, lambda _entry: None)

    intake.abandon(2)
    new = intake.round(2, lambda _entry: None)
    intake.end(old)  # its gathering thread ends after the new round was made

    assert old.abandoned and old.pulls_stop.is_set() and new is not old
    assert intake.round(2, lambda _entry: None) is new


def test_a_lost_trainer_fails_the_open_rounds_and_those_to_come(swarm: Swarm) -> None:
    intake = ResultIntake(swarm.codecs["site-1"], DXOAggregator(), ResultRules(), SITES, 1, False, "x")
    open_round = intake.round(0, lambda _entry: None)

    intake.lose([SITES[1]])

    assert open_round.failed == {SITES[1]: LOST}
    assert intake.round(1, lambda _entry: None).failed == {SITES[1]: LOST}
    intake.shutdown()
