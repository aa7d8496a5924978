"""Who may send a Swarm client what (`SwarmRoles`), and one result per trainer and round
(`RoundGathering.claim`): plain objects, no sockets."""

from __future__ import annotations

import threading
import time

import pytest

from engine.executors.ccwf.client_side import owner_among
from engine.executors.ccwf.gathering import LOST, RoundGathering
from engine.executors.ccwf.swarm_roles import MAX_REPLAYS, REPLAY_KEY, SwarmRoles
from engine.model import Shareable

SWARM = ["site-1", "site-2"]


def roles(site: str = "site-2", **changes) -> SwarmRoles:
    config = {
        "start_round": 0,
        "num_rounds": 3,
        "train_clients": SWARM,
        "aggr_clients": SWARM,
        "result_clients": SWARM,
        "starting_client": "site-1",
    }
    return SwarmRoles.from_config(site, {**config, **changes})


@pytest.mark.parametrize(
    ("sender", "header", "reason"),
    [
        (
            "site-3",
            {"round": 0, "aggr": "site-1"},
            "site-3 may not send round 1's model: it is not the starting_client",
        ),
        ("site-2.x", {"round": 0, "aggr": "site-1"}, "site-2.x may not send round 1's model"),
        (
            "site-1",
            {"round": 0, "aggr": "site-3"},
            "names 'site-3' as its aggregation client: not in aggr_clients (site-1, site-2)",
        ),
        ("site-1", {"round": 1, "aggr": "site-1"}, "round 2 is ahead: site-2 trains round 1 next"),
        ("site-1", {"round": 3, "aggr": "site-1"}, "round 4 is not a round of this swarm (1 to 3)"),
        ("site-1", {"round": -1, "aggr": "site-1"}, "round 0 is not a round of this swarm"),
        ("site-1", {"round": "0", "aggr": "site-1"}, "names no round number (round='0')"),
        ("site-1", {"round": True, "aggr": "site-1"}, "names no round number"),
        ("site-1", {"aggr": "site-1"}, "names no round number (round=None)"),
    ],
    ids=[
        "outsider",
        "child-cell-of-a-non-starter",
        "unknown-aggregator",
        "a-round-ahead",
        "past-the-last-round",
        "before-the-first-round",
        "round-as-text",
        "round-as-bool",
        "no-round",
    ],
)
def test_the_first_round_comes_only_from_the_starting_client(sender: str, header: dict, reason: str) -> None:
    assert reason in (roles().learn_refusal(sender, header) or "")


def test_later_rounds_come_in_order_from_the_previous_rounds_aggregation_client() -> None:
    site_2 = roles()

    assert site_2.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert "round 1 is past: site-2 already took round 1" in site_2.learn_refusal(
        "site-1", {"round": 0, "aggr": "site-1"}
    )
    refusal = site_2.learn_refusal("site-2.other", {"round": 1, "aggr": "site-2"})
    assert "may not send round 2's model: it is not round 1's aggregation client (site-1)" in refusal
    assert "round 3 is ahead" in site_2.learn_refusal("site-1", {"round": 2, "aggr": "site-1"})
    assert site_2.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None
    site_2.record_learn(2, "site-2")  # it started round 2 itself
    assert "round 3 is past" in site_2.learn_refusal("site-1", {"round": 2, "aggr": "site-1"})


def test_a_round_played_again_comes_only_from_its_first_sender_naming_another_aggregation_client() -> None:
    client = roles("site-3", train_clients=["site-1", "site-2", "site-3"], aggr_clients=["site-1", "site-2", "site-3"])
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert client.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None  # site-2 is then lost
    again = {"round": 1, "aggr": "site-3", REPLAY_KEY: ["site-2"]}

    assert "site-2 may not send round 2's model again: site-1 sent it" in client.learn_refusal("site-2", again)
    assert "names its aggregation client site-2 again" in client.learn_refusal("site-1", {**again, "aggr": "site-2"})
    assert "round 2 is past" in client.learn_refusal("site-1", {"round": 1, "aggr": "site-3"})  # not marked
    assert client.learn_refusal("site-1", again) is None
    assert client.last_round == 1
    assert client.learn_refusal("site-1", {**again, "aggr": "site-1"}) is None  # lost again: a third pick
    assert client.learn_refusal("site-1", {**again, "aggr": "site-3"}) is None
    assert f"played again {MAX_REPLAYS} times already" in client.learn_refusal("site-1", {**again, "aggr": "site-1"})
    for lost in ("site-2", [7], ["site-9"]):  # the lost clients: a list of the swarm's names
        assert "names lost clients that are not in the swarm" in client.learn_refusal(
            "site-1", {**again, REPLAY_KEY: lost}
        )
    # The next round comes from the aggregation client the round was played again with.
    assert "it is not round 2's aggregation client (site-3)" in client.learn_refusal(
        "site-1", {"round": 2, "aggr": "site-1"}
    )
    assert client.learn_refusal("site-3", {"round": 2, "aggr": "site-1"}) is None


def test_the_first_round_played_again_comes_only_from_the_aggregation_client_the_server_names() -> None:
    four = ["site-1", "site-2", "site-3", "site-4"]
    client = roles("site-4", train_clients=four, aggr_clients=["site-1", "site-2", "site-3"])
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    again = {"round": 0, "aggr": "site-2", REPLAY_KEY: ["site-1"]}

    # Not before the server lost the starting client and named who sends it in its place.
    assert "site-2 may not send round 1's model again: site-1 sent it" in client.learn_refusal("site-2", again)
    client.lose(["site-1"])
    assert "site-2 may not send round 1's model again: site-1 sent it" in client.learn_refusal("site-2", again)
    client.starts_again_from("site-2")
    for aggr in ("site-2", "site-3"):  # another aggregation client left, not the one named
        assert "site-3 may not send round 1's model again" in client.learn_refusal("site-3", {**again, "aggr": aggr})
    assert "site-1 may not send round 1's model" in client.learn_refusal("site-1", {**again, "aggr": "site-3"})
    assert "round 1 is past" in client.learn_refusal("site-2", {"round": 0, "aggr": "site-2"})  # not marked again
    assert client.learn_refusal("site-2.child", again) is None
    assert (client.last_round, client.latest, client.sender_of(0)) == (0, (0, "site-2"), "site-2")
    assert client.learn_refusal("site-2", {"round": 1, "aggr": "site-2"}) is None  # round 2, from round 1's aggr
    with pytest.raises(ValueError, match="cannot come again from 'site-4': not one of aggr_clients"):
        client.starts_again_from("site-4")


def test_the_first_round_played_again_is_taken_fresh_by_a_client_that_gave_it_up_or_missed_it() -> None:
    client = roles("site-3", train_clients=["site-1", "site-2", "site-3"], aggr_clients=["site-1", "site-2"])
    again = {"round": 0, "aggr": "site-2", REPLAY_KEY: ["site-1"]}
    assert "it is not the starting_client (site-1)" in client.learn_refusal("site-2", again)
    client.lose(["site-1"])
    client.starts_again_from("site-2")
    assert "it is not the starting_client (site-1)" in client.learn_refusal("site-2", {"round": 0, "aggr": "site-2"})
    assert client.learn_refusal("site-2", again) is None  # marked as sent again
    assert client.sender_of(0) == "site-2"

    lost_too = roles("site-3", train_clients=["site-1", "site-2", "site-3"], aggr_clients=["site-1", "site-2"])
    lost_too.lose(["site-1"])
    lost_too.starts_again_from("site-2")
    lost_too.lose(["site-2"])  # lost in turn
    assert "site-2 may not send round 1's model" in lost_too.learn_refusal("site-2", again)


def test_a_starting_client_without_another_role_counts_in_the_swarm() -> None:
    client = roles("site-3", train_clients=["site-2", "site-3"], aggr_clients=["site-2"], starting_client="site-1")
    assert client.in_swarm(["site-1", "site-9"]) == ["site-1"]

    # It died as round 1's model was pulled from it; this client gave the round up (took none).
    assert client.lose(["site-1"]) == ["site-1"]  # nothing from it any more; the named one sends round 1
    client.starts_again_from("site-2")
    assert "the server lost it" in client.learn_refusal("site-1", {"round": 0, "aggr": "site-2", REPLAY_KEY: []})
    assert client.learn_refusal("site-2", {"round": 0, "aggr": "site-2", REPLAY_KEY: ["site-1"]}) is None


def test_a_client_that_only_aggregates_takes_only_its_own_rounds_from_an_aggregation_client() -> None:
    site_3 = roles("site-3", aggr_clients=["site-1", "site-3"])

    assert "site-3 neither trains nor aggregates round 2" in site_3.learn_refusal(
        "site-1", {"round": 1, "aggr": "site-1"}
    )
    assert "it is not one of aggr_clients" in site_3.learn_refusal("site-2", {"round": 1, "aggr": "site-3"})
    assert site_3.learn_refusal("site-1", {"round": 1, "aggr": "site-3"}) is None


@pytest.mark.parametrize(
    ("sender", "header", "reason"),
    [
        ("site-3", {"round": 0}, "site-3 is not one of train_clients (site-1, site-2)"),
        ("server", {"round": 0}, "server is not one of train_clients"),
        ("site-1", {"round": 0.5}, "names no round number"),
        ("site-1", {"round": 0}, None),
        ("site-1", {"round": 3}, "round 4 is not a round of this swarm (1 to 3)"),
        ("site-1.job", {"round": 2}, None),  # a train client's cell; whether it is the round's, the gathering says
    ],
    ids=["outsider", "server", "fractional-round", "trainer", "past-the-last-round", "trainer-child-cell"],
)
def test_a_result_comes_only_from_a_train_client(sender: str, header: dict, reason: str | None) -> None:
    refusal = roles("site-1").result_refusal(sender, header)

    assert refusal == reason if reason is None else reason in refusal


def test_the_final_model_comes_once_for_the_last_round_from_its_aggregation_client() -> None:
    site_2 = roles()
    for current_round, aggr in enumerate(["site-1", "site-2", "site-1"]):
        if aggr == "site-2":
            site_2.record_learn(current_round, aggr)
        else:
            assert (
                site_2.learn_refusal(
                    "site-1" if current_round == 0 else "site-2", {"round": current_round, "aggr": aggr}
                )
                is None
            )

    assert "round 2 is not this swarm's last round (3)" in site_2.final_refusal("site-1", {"round": 1})
    assert "site-2.x may not send the final model: it is not the last round's aggregation client (site-1)" in (
        site_2.final_refusal("site-2.x", {"round": 2})
    )
    assert site_2.final_refusal("site-1", {"round": 2}) is None
    assert "site-2 already took the final model" in site_2.final_refusal("site-1", {"round": 2})


def test_a_trainer_takes_no_final_model_before_the_last_round_and_others_none_at_all() -> None:
    assert "has not taken round 3 yet" in roles().final_refusal("site-1", {"round": 2})
    assert "site-2 is not one of result_clients" in roles(result_clients=["site-1"]).final_refusal(
        "site-1", {"round": 2}
    )
    watcher = roles("site-3", result_clients=["site-3"])  # neither trains nor aggregates
    assert "it is not one of aggr_clients (site-1, site-2)" in watcher.final_refusal("site-4", {"round": 2})
    assert watcher.final_refusal("site-2", {"round": 2}) is None


def test_each_trainer_claims_one_result_a_round() -> None:
    gathering = RoundGathering(0, SWARM)

    assert gathering.claim("site-2") is True
    assert gathering.claim("site-2") is False
    assert gathering.claim("site-3") is False
    assert gathering.claimed == {"site-2"}


@pytest.mark.parametrize(
    ("sender", "owner"),
    [("site-1", "site-1"), ("site-1.job", "site-1"), ("site-10", None), ("server", None), ("site-1x.job", None)],
    ids=["itself", "child-cell", "name-prefix", "server", "prefixed-child"],
)
def test_a_sender_belongs_to_the_site_whose_identity_owns_its_name(sender: str, owner: str | None) -> None:
    assert owner_among(sender, ["site-1", "site-2"]) == owner


def test_nothing_is_taken_from_a_client_the_server_lost() -> None:
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three, result_clients=three)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None

    assert client.lose(["site-2"]) == ["site-2"]
    assert client.lose(["site-2", "site-1"]) == ["site-1"]  # only the new ones
    assert client.lost == {"site-1", "site-2"}
    assert "site-1 may not send round 2's model: the server lost it" in client.learn_refusal(
        "site-1.job", {"round": 1, "aggr": "site-3"}
    )
    assert "site-2 may not send a result: the server lost it" in client.result_refusal("site-2", {"round": 0})
    assert "site-2 may not send the final model: the server lost it" in client.final_refusal("site-2", {"round": 2})


@pytest.mark.parametrize("sites", ["site-1", [1], [None]], ids=["not-a-list", "a-number", "none"])
def test_the_lost_clients_must_be_a_list_of_names(sites) -> None:
    client = roles()
    with pytest.raises(ValueError, match="expected a list of client names"):
        client.lose(sites)
    assert client.lost == frozenset()


def test_lost_names_without_a_role_or_of_this_client_are_left_out() -> None:
    client = roles()  # site-2; the server may have a participant with no role in the swarm
    assert client.lose(["site-9", "site-2", "site-1"]) == ["site-1"]
    assert client.lost == {"site-1"}


def test_a_round_waits_no_longer_for_a_lost_trainer_unless_its_result_is_already_coming() -> None:
    gathering = RoundGathering(0, ["site-1", "site-2", "site-3", "site-4"])
    gathering.base = Shareable()  # the round's model is here
    gathering.claim("site-3")  # its result is being pulled
    gathering.fail("site-1", "its task failed")

    gathering.lose(["site-2", "site-3"])
    assert gathering.failed == {"site-1": "its task failed", "site-2": LOST}
    assert gathering.claim("site-2") is False
    gathering.fail("site-3", "its pull failed")
    gathering.fail("site-4", "its task failed")
    started = time.monotonic()
    assert gathering.wait_done(1, 60.0, 60.0, threading.Event()) is True  # every trainer left answered
    assert time.monotonic() - started < 1.0


def test_a_last_round_played_again_brings_its_final_model_again_from_its_new_aggregation_client() -> None:
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", num_rounds=1, train_clients=three, aggr_clients=three, result_clients=three)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None
    assert client.final_refusal("site-2", {"round": 0}) is None  # site-2 sent it, then was lost

    assert "site-3 already took the final model" in client.final_refusal("site-2", {"round": 0})
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-1", REPLAY_KEY: ["site-2"]}) is None
    assert "it is not the last round's aggregation client (site-1)" in client.final_refusal("site-2", {"round": 0})
    assert client.final_refusal("site-1", {"round": 0}) is None
    assert "site-3 already took the final model" in client.final_refusal("site-1", {"round": 0})


def test_a_round_whose_model_never_came_whole_is_given_up_and_the_round_before_may_be_played_again() -> None:
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None
    assert client.learn_refusal("site-2", {"round": 1, "aggr": "site-3"}) is None  # then site-2 dies

    assert client.untake(0) is False  # not the last round taken
    assert client.untake(1) is True
    assert (client.last_round, client.aggr_of(0)) == (0, "site-2")
    # Round 1 played again by its first sender, without site-2; round 2 again from its aggregation client.
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-3", REPLAY_KEY: ["site-2"]}) is None
    assert client.learn_refusal("site-3.x", {"round": 1, "aggr": "site-1"}) is None
    assert client.in_swarm(["site-9", "site-2"]) == ["site-2"]


def test_an_abandoned_round_stops_waiting_for_its_results_and_its_pulls() -> None:
    gathering = RoundGathering(2, ["site-1", "site-2"])
    threading.Timer(0.2, gathering.abandon).start()
    started = time.monotonic()

    assert gathering.wait_done(1, 60.0, 60.0, threading.Event()) is False
    assert time.monotonic() - started < 5 and gathering.pulls_stop.is_set()


def test_a_round_is_given_up_only_back_to_a_round_taken_before_it_and_once() -> None:
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None
    assert client.learn_refusal("site-2", {"round": 1, "aggr": "site-3"}) is None
    assert client.learn_refusal("site-3", {"round": 2, "aggr": "site-1"}) is None

    assert client.untake(1) is False  # not the last round taken
    assert client.untake(2, "site-2") is False  # round 3 is aggregated by site-1: not the model given up
    assert client.untake(2, "site-1") is True
    assert client.learn_refusal("site-2", {"round": 1, "aggr": "site-1", REPLAY_KEY: ["site-3"]}) is None
    assert client.untake(1) is False  # given up once: no second step back
    assert client.latest == (1, "site-1")


def test_the_first_round_is_given_up_back_to_no_round_and_taken_again_when_played_again() -> None:
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None

    assert client.untake(0) is True  # the starting checkpoint can be sent again
    assert client.latest == (-1, "") and client.sender_of(0) is None
    assert client.untake(0) is False  # nothing taken any more
    # The swarm went on with round 1 (site-2 had it whole): round 2 comes from its aggregation client.
    assert client.learn_refusal("site-2", {"round": 1, "aggr": "site-3"}) is None
    assert client.latest == (1, "site-3")

    played_again = roles("site-3", train_clients=three, aggr_clients=three)
    assert played_again.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None
    assert played_again.untake(0) is True
    assert played_again.learn_refusal("site-1", {"round": 0, "aggr": "site-3", REPLAY_KEY: ["site-2"]}) is None
    assert played_again.latest == (0, "site-3")


def test_a_client_that_does_not_train_gives_no_round_up_past_the_ones_it_skipped() -> None:
    aggregator = roles("site-3", aggr_clients=["site-1", "site-3"], num_rounds=5)  # site-3 does not train
    assert aggregator.learn_refusal("site-1", {"round": 1, "aggr": "site-3"}) is None
    assert aggregator.learn_refusal("site-1", {"round": 3, "aggr": "site-3"}) is None

    assert aggregator.untake(3) is False  # the round it took before round 4 is round 2, not round 3
    assert aggregator.latest == (3, "site-3")


def test_an_abandoned_round_names_the_trainers_that_had_its_model_and_not_those_that_gave_it_up() -> None:
    gathering = RoundGathering(2, ["site-1", "site-2", "site-3"])
    gathering.claim("site-1")
    gathering.given_up_by("site-1")  # its model did not reach site-1 whole either
    gathering.claim("site-3")  # a result of site-3 is coming: it had the model

    assert gathering.abandon() == ["site-3"]
    assert gathering.failed == {"site-1": "it gave the round up: the round's model did not reach it whole"}


def test_a_trainer_that_gave_a_round_up_takes_the_next_one_from_that_rounds_aggregation_client_only() -> None:
    """site-3 could not pull round 2's model (site-1, its sender, died); site-2 had it whole and went
    on without site-3: site-3 misses round 2 and takes round 3 from site-2, and from no one else."""
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three, num_rounds=4)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert client.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None
    assert client.untake(1) is True
    client.lose(["site-1"])

    assert "site-1 may not send round 3's model: the server lost it" in client.learn_refusal(
        "site-1", {"round": 2, "aggr": "site-3"}
    )
    assert "round 4 is ahead: site-3 trains round 2 next" in client.learn_refusal(
        "site-2", {"round": 3, "aggr": "site-3"}
    )
    assert "site-3 may not send round 3's model: it is not round 2's aggregation client (site-2)" in (
        client.learn_refusal("site-3", {"round": 2, "aggr": "site-3"})
    )
    assert client.learn_refusal("site-2", {"round": 2, "aggr": "site-3"}) is None
    assert client.latest == (2, "site-3")
    assert "round 2 is past" in client.learn_refusal("site-2", {"round": 1, "aggr": "site-2"})
    assert client.untake(2) is False  # round 2 was never taken: no step back past it


def test_a_trainer_that_gave_the_last_round_up_takes_the_final_model_from_its_aggregation_client() -> None:
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three, result_clients=three, num_rounds=2)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert client.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None
    assert client.untake(1) is True

    assert "it is not the last round's aggregation client (site-2)" in client.final_refusal("site-1", {"round": 1})
    assert client.final_refusal("site-2", {"round": 1}) is None
    assert "site-3 already took the final model" in client.final_refusal("site-2", {"round": 1})


def test_a_round_played_again_or_an_own_round_given_up_lets_no_round_skip() -> None:
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three, num_rounds=4)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert client.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None
    assert client.untake(1) is True
    # the server had round 1 played again instead: round 2 comes again, not round 3
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-3", REPLAY_KEY: ["site-2"]}) is None
    assert "round 3 is ahead" in client.learn_refusal("site-2", {"round": 2, "aggr": "site-1"})

    aggregator = roles("site-3", train_clients=three, aggr_clients=three, num_rounds=4)
    assert aggregator.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert aggregator.learn_refusal("site-1", {"round": 1, "aggr": "site-3"}) is None
    assert aggregator.untake(1) is True  # its own round: no one can have gone on with it
    assert "round 3 is ahead" in aggregator.learn_refusal("site-3.x", {"round": 2, "aggr": "site-1"})


def test_this_client_sending_the_round_before_again_lets_no_round_skip() -> None:
    """site-3 gave round 3 up (its sender site-1 was lost), and sends round 2 again itself (it
    aggregated round 1): the swarm did not go on without it, so round 4 from round 3's aggregation
    client is not taken."""
    four = ["site-1", "site-2", "site-3", "site-4"]
    client = roles("site-3", train_clients=four, aggr_clients=four, num_rounds=4)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-3"}) is None
    client.record_learn(1, "site-1")  # site-3 aggregated round 1 and sent round 2
    assert client.learn_refusal("site-1", {"round": 2, "aggr": "site-2"}) is None
    assert client.untake(2) is True

    client.record_learn(1, "site-4")  # round 2 sent again by site-3, to site-4 (site-1 was lost)
    assert "round 4 is ahead" in client.learn_refusal("site-2", {"round": 3, "aggr": "site-3"})
    assert client.latest == (1, "site-4")


def test_a_final_model_taken_after_the_last_round_was_given_up_does_not_count_once_it_is_played_again() -> None:
    """site-3 gave the last round up (site-2, its sender, was lost) and took the final model from its
    aggregation client site-1; the server had round 2 played again after all (by site-1, who sent
    it first): the final model taken counts no more, and the one made again is taken."""
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three, result_clients=three, num_rounds=3)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert client.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None
    assert client.learn_refusal("site-2", {"round": 2, "aggr": "site-1"}) is None
    assert client.untake(2) is True
    assert client.final_refusal("site-1", {"round": 2}) is None
    assert client.final_taken

    assert client.learn_refusal("site-1", {"round": 1, "aggr": "site-3", REPLAY_KEY: ["site-2"]}) is None
    assert not client.final_taken
    client.record_learn(2, "site-1")  # site-3 aggregated round 2 again and sent the last round
    assert client.final_refusal("site-1", {"round": 2}) is None


def test_a_trainer_drops_a_round_only_at_its_aggregation_clients_word_once_its_sender_is_lost() -> None:
    """site-3 took round 2's model whole from site-2 (round 1's aggregation client), aggregated by
    site-1; site-2 died while site-1 pulled it, and site-1 gave round 2 up: site-3 drops the round at
    site-1's word and is back at round 1, whose replay by its first sender it takes."""
    three = ["site-1", "site-2", "site-3"]
    client = roles("site-3", train_clients=three, aggr_clients=three)
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None
    assert client.learn_refusal("site-2", {"round": 1, "aggr": "site-1"}) is None

    assert client.drop_refusal("site-1", 1) == "round 2's model came from site-2, which the server did not lose"
    assert client.lose(["site-2"]) == ["site-2"]
    assert client.drop_refusal("site-2", 1) == (
        "site-2 may not send a drop of round 2: the server lost it, and the swarm went on without it"
    )
    assert client.drop_refusal("site-3", 1) == "site-3 may not drop round 2: it is not its aggregation client (site-1)"
    assert client.drop_refusal("site-1", 0) == "site-3 is not at round 1"
    assert client.drop_blocked("site-1", 1) is None  # only the server's word on site-2 is missing
    assert client.sender_of(1) == "site-2" and client.sender_of(0) is None

    assert client.drop_blocked("site-1.x", 1) is None
    assert client.drop_refusal("site-1.x", 1) is None  # a cell of site-1
    assert client.latest == (0, "site-2") and client.sender_of(0) == "site-1"
    assert client.drop_refusal("site-1", 1) is None  # said again (its answer was lost): done already
    assert client.drop_blocked("site-3", 1) == "site-3 is not at round 2"
    assert client.latest == (0, "site-2")
    # Not a round given up: round 3's model from site-1 (round 2's aggregation client, which made none) is refused.
    assert "round 3 is ahead" in (client.learn_refusal("site-1", {"round": 2, "aggr": "site-3"}) or "")
    # Round 1 played again by its first sender, without site-2.
    assert client.learn_refusal("site-1", {"round": 0, "aggr": "site-3", REPLAY_KEY: ["site-2"]}) is None
    assert client.latest == (0, "site-3")


def test_a_round_is_not_dropped_once_the_final_model_was_taken_or_without_a_round_before() -> None:
    aggregator = roles("site-3", aggr_clients=["site-1", "site-3"], num_rounds=5)  # site-3 does not train
    assert aggregator.learn_refusal("site-1", {"round": 1, "aggr": "site-3"}) is None
    aggregator.lose(["site-1"])
    assert aggregator.drop_refusal("site-3", 1) == "site-3 cannot go back to the round before round 2"

    first = roles("site-2")  # the first round: back to no round (its model is the starting checkpoint)
    assert first.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None
    first.lose(["site-1"])
    assert first.drop_refusal("site-2", 0) is None
    assert first.latest == (-1, "")

    three = ["site-1", "site-2", "site-3"]
    last = roles("site-3", num_rounds=2, train_clients=three, aggr_clients=three, result_clients=three)
    assert last.learn_refusal("site-1", {"round": 0, "aggr": "site-2"}) is None
    assert last.learn_refusal("site-2", {"round": 1, "aggr": "site-1"}) is None
    assert last.final_refusal("site-1", {"round": 1}) is None  # the swarm finished
    last.lose(["site-2"])
    assert last.drop_refusal("site-1", 1) == "site-3 cannot go back to the round before round 2"
    assert last.latest == (1, "site-1")
