"""A Swarm client's round given up when its model's sender is lost mid-pull (`GiveUp`), and what
shows the swarm went on without it: plain objects, no sockets."""

from __future__ import annotations

import threading
import time

import pytest

from engine.executors.ccwf.swarm_give_up import GiveUp
from engine.executors.ccwf.swarm_roles import REPLAY_KEY, SwarmRoles

THREE = ["site-1", "site-2", "site-3"]


def give_up(num_rounds: int = 5) -> tuple[GiveUp, list[str]]:
    """site-3's `GiveUp`, with rounds 1 (from site-1, aggregated by site-1) and 2 (from site-1,
    aggregated by site-2) taken; the errors it reports."""
    roles = SwarmRoles.from_config(
        "site-3",
        {
            "start_round": 0,
            "num_rounds": num_rounds,
            "train_clients": THREE,
            "aggr_clients": THREE,
            "result_clients": THREE,
            "starting_client": "site-1",
        },
    )
    assert roles.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert roles.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None
    errors: list[str] = []
    return GiveUp("site-3", roles, threading.Event(), errors.append), errors


def test_a_round_given_up_goes_back_to_the_round_before_once() -> None:
    tracker, _ = give_up()
    assert tracker.roles.learn_refusal("site-2", {"round": 2, "aggr": "site-1"}) is None

    assert tracker.round(2, "site-1", "site-2") is True
    assert tracker.given_up == (2, "site-1") and tracker.roles.latest == (1, "site-2")
    with pytest.raises(RuntimeError, match="round 2's model could not be received: its sender site-1 was lost"):
        tracker.round(1, "site-2", "site-1")  # no second step back
    assert tracker.given_up is None


def test_the_first_round_given_up_goes_back_to_no_round_unless_it_was_played_again_meanwhile() -> None:
    tracker, _ = give_up()
    assert tracker.round(1, "site-2", "site-1") is True  # back at round 1
    # Round 1 played again by site-1 (site-2 was lost), and site-1 lost as it is pulled: back to
    # no round, a second step back that only the first round allows.
    assert tracker.roles.learn_refusal("site-1", {"round": 0, "aggr": "site-3", REPLAY_KEY: ["site-2"]}) is None
    assert tracker.round(0, "site-3", "site-1") is True
    assert tracker.roles.latest == (-1, "") and tracker.given_up == (0, "site-3")

    tracker, _ = give_up(num_rounds=5)
    assert tracker.round(1, "site-2", "site-1") is True
    tracker.roles.lose(["site-1"])  # the starting client: site-2 sends round 1 again, taken as it is pulled
    tracker.roles.starts_again_from("site-2")
    assert tracker.roles.learn_refusal("site-2", {"round": 0, "aggr": "site-2", REPLAY_KEY: ["site-1"]}) is None
    assert tracker.round(0, "site-1", "site-1") is False  # the pull of the first sending failed: the new one counts
    assert tracker.roles.latest == (0, "site-2") and tracker.given_up is None


def test_a_round_whose_next_one_comes_as_it_is_given_up_is_not_given_up() -> None:
    tracker, _ = give_up()
    untake = tracker.roles.untake

    def untake_once_the_next_round_came(current_round: int, aggr: str | None = None) -> bool:  # a handler's race
        assert tracker.roles.learn_refusal("site-2", {"round": 2, "aggr": "site-3"}) is None
        return untake(current_round, aggr)

    tracker.roles.untake = untake_once_the_next_round_came  # type: ignore[method-assign]
    assert tracker.round(1, "site-2", "site-1") is False
    assert tracker.given_up is None and tracker.roles.latest == (2, "site-3")


def test_the_last_round_is_not_given_up_once_its_final_model_was_taken() -> None:
    tracker, _ = give_up(num_rounds=2)
    assert tracker.roles.final_refusal("site-2", {"round": 1}) is None  # site-2 aggregated it: the final model

    assert tracker.round(1, "site-2", "site-1") is False
    assert tracker.roles.latest == (1, "site-2") and tracker.roles.final_taken


def test_a_round_whose_next_one_was_taken_already_is_not_given_up() -> None:
    tracker, _ = give_up()
    assert tracker.roles.learn_refusal("site-2", {"round": 2, "aggr": "site-3"}) is None

    assert tracker.round(1, "site-2", "site-1") is False
    assert tracker.given_up is None and tracker.roles.latest == (2, "site-3")


def test_only_a_model_past_the_round_after_the_one_given_up_shows_the_swarm_went_on_without_it() -> None:
    tracker, _ = give_up()
    tracker.round(1, "site-2", "site-1")
    tracker.roles.lose(["site-1"])

    assert not tracker.went_on_past("site-2", {"round": 2, "aggr": "site-3"})  # the next one: taken instead
    assert tracker.went_on_past("site-2", {"round": 3, "aggr": "site-3"})
    assert tracker.went_on_past("site-2.child", {"round": 3, "aggr": "site-1"})
    assert not tracker.went_on_past("site-1", {"round": 3, "aggr": "site-3"})  # lost
    assert not tracker.went_on_past("site-9", {"round": 3, "aggr": "site-3"})  # no aggregation client
    assert not tracker.went_on_past("site-2", {"round": 3, "aggr": "site-9"})
    assert not tracker.went_on_past("site-2", {"round": 3, "aggr": "site-3", REPLAY_KEY: []})
    assert not tracker.went_on_past("site-2", {"round": 5, "aggr": "site-3"})  # not a round of the swarm
    assert not tracker.went_on_past("site-2", {"round": "3", "aggr": "site-3"})
    tracker.taken()
    assert not tracker.went_on_past("site-2", {"round": 3, "aggr": "site-3"})


@pytest.mark.parametrize(("num_rounds", "shows"), [(2, False), (3, True)])
def test_a_final_model_shows_the_swarm_went_on_only_past_the_round_after_the_one_given_up(
    num_rounds: int, shows: bool
) -> None:
    """Round 2 given up: as the last round, its final model is taken (no sign of anything); with a
    round 3, a final model shows the swarm went past round 3 without this client."""
    tracker, _ = give_up(num_rounds)
    tracker.round(1, "site-2", "site-1")
    tracker.roles.lose(["site-1"])

    last = {"round": num_rounds - 1}
    assert tracker.final_went_on_past("site-2", last) is shows
    assert tracker.final_went_on_past("site-1", last) is False  # lost
    for malformed in ({"round": num_rounds - 2}, {"round": str(num_rounds - 1)}, {}):
        assert tracker.final_went_on_past("site-2", malformed) is False


def test_only_a_round_this_client_aggregates_and_gave_up_has_its_trainers_drop_it() -> None:
    tracker, _ = give_up()
    assert tracker.roles.learn_refusal("site-2", {"round": 2, "aggr": "site-3"}) is None
    assert tracker.roles.learn_refusal("site-3.x", {"round": 3, "aggr": "site-1"}) is None

    tracker.round(3, "site-1", "site-3.x")
    assert not tracker.gave_up_own_round(3)  # site-1 aggregates round 4, not this client

    other, _ = give_up()
    assert other.roles.learn_refusal("site-2", {"round": 2, "aggr": "site-3"}) is None
    other.round(2, "site-3", "site-2")
    assert other.gave_up_own_round(2) and not other.gave_up_own_round(1)


def test_left_behind_ends_the_job_once_and_only_after_a_round_was_given_up() -> None:
    tracker, errors = give_up()
    tracker.left_behind("nothing given up")
    assert errors == []

    tracker.round(1, "site-2", "site-1")
    tracker.left_behind("round 4's model came from site-2")
    tracker.left_behind("again")

    assert errors == [
        "site-3 could not receive round 2's model (its sender was lost) while the swarm went on with it: "
        "round 4's model came from site-2"
    ]


def test_a_pull_is_stopped_when_its_sender_is_lost_before_or_during_it_and_at_the_end() -> None:
    tracker, _ = give_up()
    with tracker.pulling("site-1.job") as stop:
        tracker.senders_lost(["site-2"])
        assert not stop.is_set()
        tracker.senders_lost(["site-1"])
        assert stop.is_set()
    tracker.senders_lost(["site-1"])  # no pull: nothing to stop

    tracker.roles.lose(["site-1"])
    with tracker.pulling("site-1") as stop:
        assert stop.is_set()  # told before the pull began
    with tracker.pulling("site-2") as stop:
        tracker.stop()
        assert stop.is_set()


def test_lost_soon_waits_for_the_servers_word_at_most_the_time_given() -> None:
    tracker, _ = give_up()
    started = time.monotonic()
    assert tracker.lost_soon("site-1", 0.3) is False
    assert 0.3 <= time.monotonic() - started < 2

    threading.Timer(0.2, tracker.roles.lose, args=(["site-1"],)).start()
    assert tracker.lost_soon("site-1.job", 10.0) is True
    assert time.monotonic() - started < 3


def test_each_trainer_is_asked_to_drop_a_round_given_up_once() -> None:
    tracker, _ = give_up()
    assert tracker.roles.learn_refusal("site-2", {"round": 2, "aggr": "site-3"}) is None
    tracker.round(2, "site-3", "site-2")

    assert tracker.to_drop(["site-1", "site-2", "site-1"]) == ["site-1", "site-2"]
    assert tracker.to_drop(["site-2", "site-4"]) == ["site-4"]
    tracker.taken()  # a round taken: the next round given up asks everyone anew
    assert tracker.to_drop(["site-1"]) == ["site-1"]
