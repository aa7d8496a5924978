"""Client-controlled workflows over real CURVE cells while sites with valid keys lie to their peers:
a site outside the swarm, and a child cell of a swarm site, send round models, results and final
models out of turn; a site that is no evaluator asks for a model. Each is refused with an error
reply, and the swarm still ends with the exact model."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.aggregators import DXOAggregator
from engine.cells import CellSettings, Message, Status
from engine.executors.ccwf import CrossSiteEvalClientController, SwarmClientController
from engine.executors.ccwf.client_side import ClientSideController
from engine.executors.executor import ExecutorContext
from engine.model import DXO, DataKind, FLModel, ReturnCode, Shareable, model_from_shareable, shareable_from_model
from engine.model.ccwf import CCWF_CHANNEL, CONFIG_KEY, LOST_KEY, MODEL_NAME_KEY, MODEL_OWNER_KEY, WorkflowStatus
from engine.persistors import ModelPersistor
from engine.security import write_site_key_folders
from engine.site import SiteEndpoint, SiteSettings
from engine.workflows import FullModelShareableGenerator

SWARM = ["site-1", "site-2"]
FAST = CellSettings(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
WAIT_S = 20.0
INITIAL = torch.arange(4, dtype=torch.float64)
STEP = {"site-1": 0.1, "site-2": 0.2}  # what each site's training adds; equal weights
ROUNDS = 2
FINAL = INITIAL + ROUNDS * (STEP["site-1"] + STEP["site-2"]) / 2


class MemoryPersistor(ModelPersistor):
    """Starts from ``INITIAL`` and keeps every saved model in memory."""

    def __init__(self) -> None:
        self.saved: list[FLModel] = []

    def load_model(self) -> FLModel:
        return self.saved[-1] if self.saved else FLModel(params={"w": INITIAL.clone()})

    def save_model(self, model: FLModel) -> Path:
        self.saved.append(model)
        return Path("memory")


class Site:
    """One client job of the workflow: its endpoint, its controller, its status reports."""

    def __init__(self, endpoint: SiteEndpoint, controller: ClientSideController, workspace: Path) -> None:
        self.name = endpoint.cell.fqcn
        self.endpoint = endpoint
        self.controller = controller
        self.persistor = MemoryPersistor()
        self.statuses: list[WorkflowStatus] = []
        self.hold: dict[int, threading.Event] = {}  # round -> released when training may finish
        self.changed = threading.Condition()
        controller.initialize(
            ExecutorContext(
                self.name,
                "job-1",
                workspace,
                components={
                    "persistor": self.persistor,
                    "aggregator": DXOAggregator(expected_data_kind="WEIGHTS"),
                    "shareable_generator": FullModelShareableGenerator(),
                },
                cell=endpoint.cell,
                codec=endpoint.codec,
                run_task=self.run_task,
                report_status=self.report,
            )
        )

    def run_task(self, name: str, data: Shareable, abort: threading.Event) -> Shareable:
        """The site's trainer: ``train`` adds the site's step; ``submit_model`` and ``validate`` for cse."""
        if name == "submit_model":
            reply = shareable_from_model(FLModel(params={"w": INITIAL + STEP[self.name]}))
        elif name == "validate":
            mean = model_from_shareable(data).params["w"].mean().item()
            reply = shareable_from_model(FLModel(metrics={"mean": mean}))
        else:
            dxo = DXO.from_shareable(data)
            current_round = data.get_header("current_round")
            if current_round in self.hold:
                assert self.hold[current_round].wait(WAIT_S)
            new = {"w": dxo.data["w"] + STEP[self.name]}
            reply = DXO(DataKind.WEIGHTS, new, {"NUM_STEPS_CURRENT_ROUND": 1}).to_shareable()
        reply.set_return_code(ReturnCode.OK)
        return reply

    def report(self, status: WorkflowStatus) -> None:
        with self.changed:
            self.statuses.append(status)
            self.changed.notify_all()

    def wait_status(self, what: str, predicate) -> WorkflowStatus:
        deadline = time.monotonic() + WAIT_S
        with self.changed:
            while True:
                found = [status for status in self.statuses if predicate(status)]
                if found:
                    return found[-1]
                left = deadline - time.monotonic()
                assert left > 0, f"{self.name}: no status where {what} in {WAIT_S} s: {self.statuses[-3:]}"
                self.changed.wait(left)

    def execute(self, task: str, data: Shareable | None = None) -> Shareable:
        return self.controller.execute(task, data if data is not None else Shareable(), threading.Event())

    def errors(self) -> list[str]:
        return [status.error for status in self.statuses if status.error]


class Network:
    """A keyed server cell, the workflow's sites, and liars with valid keys of their own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.keys = write_site_key_folders(folder / "keys", "server", [*SWARM, "site-3"])
        self.endpoints: list[SiteEndpoint] = []
        self.sites: dict[str, Site] = {}
        self.server = self.open("server")

    def open(self, site: str, name: str | None = None) -> SiteEndpoint:
        connect_to = None if site == "server" else self.server.cell.endpoint
        settings = SiteSettings(site, FAST, self.keys[site])
        endpoint = SiteEndpoint.for_site(settings, {}, connect_to=connect_to, cell_name=name).start()
        self.endpoints.append(endpoint)
        if connect_to is not None:
            assert endpoint.cell.wait_connected(WAIT_S), endpoint.cell.link_error
        return endpoint

    def start_sites(self, make_controller) -> dict[str, Site]:
        for name in SWARM:
            workspace = self.folder / name
            workspace.mkdir()
            self.sites[name] = Site(self.open(name), make_controller(), workspace)
        return self.sites

    def close(self) -> None:
        for site in self.sites.values():
            site.controller.finalize()
        for endpoint in reversed(self.endpoints):
            endpoint.close()


@pytest.fixture
def network(tmp_path: Path) -> Iterator[Network]:
    network = Network(tmp_path)
    try:
        yield network
    finally:
        network.close()


SWARM_CONFIG = {
    "num_rounds": ROUNDS,
    "start_round": 0,
    "participants": SWARM,
    "status_interval": 5.0,
    "aggr_clients": SWARM,
    "train_clients": SWARM,
    "result_clients": SWARM,
    "starting_client": "site-1",
}


def start_swarm(
    network: Network, num_rounds: int = ROUNDS, submit_interval_s: float = 1.0, **config: Any
) -> dict[str, Site]:
    sites = network.start_sites(
        lambda: SwarmClientController(
            min_responses_required=2,
            wait_time_after_min_resps_received=0,
            learn_task_timeout=30,
            learn_task_ack_timeout=5,
            request_to_submit_result_interval=submit_interval_s,
        )
    )
    for site in sites.values():
        swarm_config = {**SWARM_CONFIG, "num_rounds": num_rounds, **config}
        assert site.execute("swarm_config", Shareable({CONFIG_KEY: swarm_config})).get_return_code() is (ReturnCode.OK)
    return sites


def send(liar: SiteEndpoint, target: str, topic: str, header: dict[str, Any], value: float = 1000.0) -> Message:
    """``liar`` sends ``target`` a Swarm message carrying a model of its own; the reply (never raised)."""
    model = DXO(DataKind.WEIGHTS, {"w": torch.full((4,), value, dtype=torch.float64)}, {"NUM_STEPS_CURRENT_ROUND": 1})
    data = model.to_shareable()
    data.set_return_code(ReturnCode.OK)
    if topic == "learn" and type(header.get("round")) is int:
        data.set_header("current_round", header["round"])  # as a sender's round model says
    frames = liar.codec.encode(data, receivers=[target])
    header = {**header, "trainers": SWARM}  # as senders before the role checks wrote it
    return liar.cell.request_async(target, CCWF_CHANNEL, f"swarm_{topic}", header, frames).result(WAIT_S)


def assert_refused(reply: Message, reason: str) -> None:
    assert reply.status is Status.ERROR, f"taken, not refused: {reply.header}"
    assert reason in reply.reason, reply.reason


def finish_swarm(sites: dict[str, Site]) -> None:
    """Start the swarm at site-1 and wait until it is done; both sites end with the exact model."""
    assert sites["site-1"].execute("swarm_start").get_return_code() is ReturnCode.OK
    for site in sites.values():
        site.wait_status("the final model is saved", lambda status: status.phase == "done" or bool(status.error))
    for site in sites.values():
        assert site.errors() == []
        final = site.persistor.saved[-1]
        assert torch.allclose(final.params["w"], FINAL, rtol=0, atol=1e-12), (site.name, final.params["w"])


def test_a_site_outside_the_swarm_is_refused_every_message_and_the_swarm_finishes_exact(
    network: Network, caplog: pytest.LogCaptureFixture
) -> None:
    sites = start_swarm(network)
    outsider = network.open("site-3")

    with caplog.at_level(logging.WARNING, logger="engine.executors.ccwf"):
        learn = {target: send(outsider, target, "learn", {"round": 0, "aggr": "site-1"}) for target in SWARM}
        result = send(outsider, "site-1", "result", {"round": 0, "ok": True})
        final = {target: send(outsider, target, "final", {"round": ROUNDS - 1}) for target in SWARM}
        finish_swarm(sites)
        late_final = send(outsider, "site-1", "final", {"round": ROUNDS - 1})

    for target in SWARM:
        assert_refused(learn[target], "site-3 may not send round 1's model: it is not the starting_client (site-1)")
    assert_refused(result, "site-3 is not one of train_clients (site-1, site-2)")
    assert_refused(final["site-1"], "site-1 has not taken round 2 yet")
    assert_refused(final["site-2"], "site-2 has not taken round 2 yet")
    assert_refused(late_final, "site-1 already took the final model")
    assert "peer message refused: from=site-3 topic=swarm_learn reason=site-3 may not send" in caplog.text


def test_a_swarm_site_cannot_send_rounds_out_of_turn_nor_a_second_result(network: Network) -> None:
    sites = start_swarm(network)
    liar = network.open("site-2", name="site-2.liar")  # site-2's key: a configured trainer and aggregator
    outsider = network.open("site-3")

    early = {
        "round 1's model first": send(liar, "site-1", "learn", {"round": 1, "aggr": "site-2"}),
        "round 0's model": send(liar, "site-1", "learn", {"round": 0, "aggr": "site-2"}),
        "a round past the last": send(liar, "site-1", "learn", {"round": ROUNDS, "aggr": "site-1"}),
        "a round as text": send(liar, "site-1", "learn", {"round": "0", "aggr": "site-1"}),
        "a result for round 0": send(liar, "site-1", "result", {"round": 0, "ok": True}),
        "a result far ahead": send(liar, "site-1", "result", {"round": 10**6, "ok": True}),
    }
    sites["site-1"].hold[0] = threading.Event()  # site-1 aggregates round 0 and trains it slowly
    assert sites["site-1"].execute("swarm_start").get_return_code() is ReturnCode.OK
    sites["site-2"].wait_status("site-2 handed in round 0", lambda s: s.round == 0 and s.phase == "idle")
    during = {
        "a second result": send(liar, "site-1", "result", {"round": 0, "ok": True}),
        "a failed second result": send(liar, "site-1", "result", {"round": 0, "ok": False}),
        "an outsider's result": send(outsider, "site-1", "result", {"round": 0, "ok": True}),
        "a past round": send(liar, "site-1", "result", {"round": -1, "ok": True}),
    }
    sites["site-1"].hold[0].set()
    for site in sites.values():
        site.wait_status("the final model is saved", lambda status: status.phase == "done" or bool(status.error))

    assert_refused(early["round 1's model first"], "round 2 is ahead: site-1 trains round 1 next")
    assert_refused(early["round 0's model"], "site-2.liar may not send round 1's model")
    assert_refused(early["a round past the last"], f"round {ROUNDS + 1} is not a round of this swarm")
    assert_refused(early["a round as text"], "the message names no round number (round='0')")
    assert_refused(early["a result for round 0"], "site-1 does not aggregate round 1")
    assert_refused(early["a result far ahead"], "round 1000001 is not a round of this swarm (1 to 2)")
    assert_refused(during["a second result"], "site-2 already sent its result for round 1")
    assert_refused(during["a failed second result"], "site-2 already sent its result for round 1")
    assert_refused(during["an outsider's result"], "site-3 is not one of train_clients")
    assert_refused(during["a past round"], "round 0 is not a round of this swarm")
    for site in sites.values():
        assert site.errors() == []
        assert torch.allclose(site.persistor.saved[-1].params["w"], FINAL, rtol=0, atol=1e-12), site.name
    [done_0] = [d for d in sites["site-1"].statuses[-1].rounds_done if d["round"] == 0]
    assert done_0["clients"] == SWARM


@pytest.mark.parametrize("sent", ["far larger", "malformed"])
def test_a_round_model_far_larger_than_the_last_or_malformed_is_refused_before_it_is_pulled(
    network: Network, sent: str
) -> None:
    """A trainer bounds a peer's round model by the model it last held (2 x its bytes + 16 MiB):
    a liar with the sending site's key cannot make it reserve or pull 20 MiB after 32 bytes, nor
    pass off frames that are no FOBS message. The error comes at once: the sender's own doing is
    no sign of a lost sender to wait for (the heartbeat timeout and three status intervals, 17 s here)."""
    sites = start_swarm(network)
    liar = network.open("site-1", name="site-1.liar")  # site-1's key: it sends round 2's model
    sites["site-1"].hold[0] = threading.Event()  # site-1 aggregates round 1 and trains it slowly
    try:
        assert sites["site-1"].execute("swarm_start").get_return_code() is ReturnCode.OK
        sites["site-2"].wait_status("site-2 handed in round 1", lambda s: s.round == 0 and s.phase == "idle")
        huge = DXO(DataKind.WEIGHTS, {"w": torch.zeros(5 << 20, dtype=torch.float32)}).to_shareable()
        frames = liar.codec.encode(huge, receivers=["site-2"]) if sent == "far larger" else [b"\x93not fobs"]
        reply = liar.cell.request(
            "site-2", CCWF_CHANNEL, "swarm_learn", {"round": 1, "aggr": "site-2"}, frames, timeout_s=WAIT_S
        )
        assert reply.ok  # admitted by its sender's role; the size is checked as it is decoded
        sent_at = time.monotonic()
        status = sites["site-2"].wait_status("site-2 refused it", lambda s: bool(s.error))
        assert time.monotonic() - sent_at < 5
    finally:
        sites["site-1"].hold[0].set()

    if sent == "far larger":
        assert "more than round 2's model from site-1.liar (at most 2 x the model of 32 bytes" in status.error
    else:
        assert status.error.startswith("round 2 on site-2: MalformedMessageError: malformed FOBS message")
    assert liar.service.bytes_served() == {}


def test_a_trainer_whose_aggregation_client_is_gone_drops_its_result_within_the_heartbeat_timeout(
    network: Network, caplog: pytest.LogCaptureFixture
) -> None:
    """site-1 aggregates round 1 and dies while site-2 trains it: site-2 stops handing in its result
    after the heartbeat timeout (2 s here), not after request_to_submit_result_max_wait (30 s), and
    waits for the server to have the round played again (or end the job): no error of its own."""
    sites = start_swarm(network)
    sites["site-2"].hold[0] = threading.Event()
    try:
        assert sites["site-1"].execute("swarm_start").get_return_code() is ReturnCode.OK
        sites["site-2"].wait_status("site-2 trains round 1", lambda s: s.round == 0 and s.phase == "training")
        sites["site-1"].endpoint.close()  # its process ends: the server forgets its cell
        died = time.monotonic()
    finally:
        sites["site-2"].hold[0].set()

    with caplog.at_level(logging.WARNING, logger="engine.executors.ccwf.swarm"):
        status = sites["site-2"].wait_status("site-2 gave up", lambda s: s.round == 0 and s.phase == "idle")
    assert time.monotonic() - died < 12
    assert status.error is None and status.aggr == "site-1"  # what the server judges the loss by
    assert "round 1: result not handed in: aggregation client site-1 is gone (unreachable for" in caplog.text


def test_a_straggler_whose_round_is_past_drops_its_result_when_that_rounds_aggregator_is_gone(
    network: Network,
) -> None:
    """site-2 still hands in round 1's result, but it already took round 2's model (round 1
    closed without it): round 1's aggregation client being gone does not end the swarm."""
    sites = start_swarm(network)
    roles = sites["site-2"].controller.roles
    assert roles.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert roles.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None
    sites["site-1"].endpoint.close()
    result = DXO(DataKind.WEIGHTS, {"w": INITIAL.clone()}, {"NUM_STEPS_CURRENT_ROUND": 1}).to_shareable()
    result.set_return_code(ReturnCode.OK)
    started = time.monotonic()

    sites["site-2"].controller.hand_in.submit("site-1", 0, result)  # returns: nothing raised

    assert time.monotonic() - started < 1.5  # at the first failed try, not after the heartbeat timeout


CSE_CONFIG = {
    "participants": SWARM,
    "status_interval": 5.0,
    "evaluators": ["site-2"],
    "evaluatees": SWARM,
    "global_model_client": "site-1",
    "starting_client": "",
}


def test_only_a_named_evaluator_gets_a_sites_model(network: Network) -> None:
    sites = network.start_sites(CrossSiteEvalClientController)
    for site in sites.values():
        assert site.execute("cse_config", Shareable({CONFIG_KEY: dict(CSE_CONFIG)})).get_return_code() is (
            ReturnCode.OK
        )
    outsider = network.open("site-3")

    asked = {
        name: endpoint.cell.request_async("site-1", CCWF_CHANNEL, "cse_get_model", {MODEL_NAME_KEY: "local"}).result(
            WAIT_S
        )
        for name, endpoint in [("site-3", outsider), ("site-1's peer site-2", sites["site-2"].endpoint)]
    }
    evaluated = sites["site-2"].execute("cse_eval", Shareable({MODEL_OWNER_KEY: "site-1", MODEL_NAME_KEY: "local"}))
    stranger_owner = sites["site-2"].execute(
        "cse_eval", Shareable({MODEL_OWNER_KEY: "site-3", MODEL_NAME_KEY: "local"})
    )
    not_an_evaluator = sites["site-1"].execute(
        "cse_eval", Shareable({MODEL_OWNER_KEY: "site-2", MODEL_NAME_KEY: "local"})
    )

    assert_refused(asked["site-3"], "site-3 is not one of the evaluators (site-2); no model for it")
    assert asked["site-1's peer site-2"].status is Status.OK
    assert evaluated.get_return_code() is ReturnCode.OK
    assert model_from_shareable(evaluated).metrics["mean"] == pytest.approx((INITIAL + STEP["site-1"]).mean().item())
    assert stranger_owner.get_return_code() is ReturnCode.BAD_TASK_DATA
    assert "site-3 holds no model 'local' to evaluate in this workflow" in stranger_owner.get_header("reason")
    assert not_an_evaluator.get_return_code() is ReturnCode.EXECUTION_EXCEPTION  # site-2 will not serve site-1
    assert "site-1 is not one of the evaluators (site-2)" in not_an_evaluator.get_header("reason")


def test_a_trainer_gives_a_round_up_when_its_models_sender_is_lost_and_goes_on_with_the_next(
    network: Network, caplog: pytest.LogCaptureFixture
) -> None:
    """site-2 takes round 2's model from site-1 (a cell of it) while still training round 1; the
    server then loses site-1. site-2's learner gets to round 2, cannot pull it, gives it up (back
    at round 1, its result handed in as given up), and takes round 3's model from site-3, round 2's
    aggregation client, which had it whole: the whole path of `_receive`, on real cells."""
    three = [*SWARM, "site-3"]
    sites = start_swarm(network, num_rounds=3, train_clients=three, aggr_clients=three, participants=three)
    site_2 = sites["site-2"]
    site_1 = network.open("site-1", name="site-1.sender")
    site_3 = network.open("site-3")
    site_2.hold[0] = threading.Event()
    try:
        reply = send(site_1, "site-2", "learn", {"round": 0, "aggr": "site-1"})
        assert reply.status is Status.OK, reply.reason
        site_2.wait_status("site-2 trains round 1", lambda s: s.round == 0 and s.phase == "training")
        reply = send(site_1, "site-2", "learn", {"round": 1, "aggr": "site-3"})  # queued behind round 1
        assert reply.status is Status.OK, reply.reason
        assert site_2.execute("swarm_lost", Shareable({LOST_KEY: ["site-1"]})).get_return_code() is ReturnCode.OK
    finally:
        site_2.hold[0].set()

    with caplog.at_level(logging.WARNING, logger="engine.executors.ccwf"):
        site_2.wait_status(
            "site-2 gave round 2 up", lambda s: s.round == 0 and s.phase == "idle" and s.aggr == "site-1"
        )
        assert site_2.controller.give_up.given_up == (1, "site-3")
        reply = send(site_3, "site-2", "learn", {"round": 2, "aggr": "site-2"}, value=5.0)
        assert reply.status is Status.OK, reply.reason
        site_2.wait_status("site-2 trains round 3", lambda s: s.round == 2 and s.phase == "training")

    assert "round 2's model not received: the server lost its sender site-1.sender" in caplog.text
    assert site_2.errors() == [] and site_2.controller.give_up.given_up is None


def gave_round_2_up(network: Network, num_rounds: int) -> dict[str, Site]:
    """A swarm of site-1, site-2 and site-3 (site-3 a bare endpoint opened by the test) where site-2
    took round 1, and gave round 2 up: its model, from site-1, aggregated by site-3, did not come
    whole (as `_receive` gives it up when the pull fails)."""
    three = [*SWARM, "site-3"]
    sites = start_swarm(network, num_rounds=num_rounds, train_clients=three, aggr_clients=three, participants=three)
    controller = sites["site-2"].controller
    assert controller.roles.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert controller.roles.learn_refusal("site-1", {"round": 1, "aggr": "site-3"}) is None
    assert controller.give_up.round(1, "site-3", "site-1") is True
    return sites


def test_a_trainer_that_gave_a_round_up_goes_on_with_the_next_round_from_that_rounds_aggregation_client(
    network: Network,
) -> None:
    """site-2 could not pull round 2's model (site-1, its sender, was lost) and went back to round 1;
    site-3 had round 2's model whole and aggregated it without site-2: site-2 misses round 2, takes
    round 3's model from site-3 (from no one else) and trains it, with no error."""
    sites = gave_round_2_up(network, num_rounds=3)
    controller = sites["site-2"].controller
    assert sites["site-2"].execute("swarm_lost", Shareable({LOST_KEY: ["site-1"]})).get_return_code() is ReturnCode.OK
    site_3 = network.open("site-3")

    assert_refused(send(sites["site-1"].endpoint, "site-2", "learn", {"round": 2, "aggr": "site-2"}), "lost it")
    assert_refused(send(site_3, "site-2", "learn", {"round": 1, "aggr": "site-3"}), "not round 1's aggregation")
    other = network.open("site-2", name="site-2.other")  # an aggregation client, not round 2's
    assert_refused(send(other, "site-2", "learn", {"round": 2, "aggr": "site-2"}), "not round 2's aggregation")
    reply = send(site_3, "site-2", "learn", {"round": 2, "aggr": "site-2"}, value=5.0)

    assert reply.status is Status.OK, reply.reason
    status = sites["site-2"].wait_status("site-2 trains round 3", lambda s: s.round == 2 and s.phase == "training")
    assert status.aggr == "site-2" and sites["site-2"].errors() == []
    assert controller.give_up.given_up is None


def test_a_trainer_that_gave_the_last_round_up_saves_the_final_model_from_that_rounds_aggregation_client(
    network: Network,
) -> None:
    """As above, with round 2 the last: site-2 takes the final model from site-3 (round 2's
    aggregation client, which had the round whole), saves it and is done; site-1's is refused."""
    sites = gave_round_2_up(network, num_rounds=2)
    controller = sites["site-2"].controller
    site_3 = network.open("site-3")

    assert_refused(send(sites["site-1"].endpoint, "site-2", "final", {"round": 1}), "not the last round's aggregation")
    reply = send(site_3, "site-2", "final", {"round": 1}, value=5.0)

    assert reply.status is Status.OK, reply.reason
    assert sites["site-2"].wait_status("site-2 saved it", lambda s: s.phase == "done")
    assert torch.equal(sites["site-2"].persistor.saved[-1].params["w"], torch.full((4,), 5.0, dtype=torch.float64))
    assert controller.give_up.given_up is None and sites["site-2"].errors() == []


def test_a_client_that_gave_a_round_up_ends_the_job_when_the_swarm_goes_on_past_the_next_round(
    network: Network,
) -> None:
    """site-2 could not pull round 2's model (its sender was lost) and went back to round 1, to be
    played again; but round 4's model comes: the swarm went on without it past round 3 too, which it
    cannot follow, so site-2 reports an error (the job ends with it) instead of waiting for ever."""
    sites = start_swarm(network, num_rounds=4)
    controller = sites["site-2"].controller
    assert controller.roles.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert controller.roles.learn_refusal("site-1", {"round": 1, "aggr": "site-1"}) is None
    assert controller.give_up.round(1, "site-1", "site-1") is True  # as `_receive` does when its pull fails
    liar = sites["site-1"].endpoint
    for header, reason in (
        ({"round": 10**6, "aggr": "site-1"}, "is not a round of this swarm"),
        ({"round": 3, "aggr": "nobody"}, "not in aggr_clients"),
        ({"round": 0, "aggr": "site-1", "replay": ["site-2"]}, "names its aggregation client site-1 again"),
    ):  # refused, and none of them says the swarm went on
        assert_refused(send(liar, "site-2", "learn", header), reason)
    assert controller.status.error is None

    assert_refused(send(liar, "site-2", "learn", {"round": 3, "aggr": "site-1"}), "is ahead")
    assert controller.status.error == (
        "site-2 could not receive round 2's model (its sender was lost) while the swarm went on with it: "
        "round 4's model came from site-1"
    )


def wait_for_drop_askers(site: str) -> None:
    """Wait until ``site`` asks no trainer to drop a round any more (its `RoundDrop` threads ended)."""
    deadline = time.monotonic() + WAIT_S
    while [thread for thread in threading.enumerate() if thread.name.startswith(f"{site}-drop-")]:
        assert time.monotonic() < deadline, f"{site} is still asking trainers to drop a round"
        time.sleep(0.05)


def aggregator_gave_its_round_up(network: Network, **config: Any) -> tuple[dict[str, Site], SiteEndpoint]:
    """A swarm of site-1, site-2 and site-3 (a bare endpoint opened by the test) where both sites
    took round 1 (aggregated by site-3) and round 2's model from site-3, aggregated by site-2;
    site-3 was lost as site-2 pulled it, so site-2 gave its own round up (as `_receive` does),
    while site-1 had the model whole. The lost site-3's endpoint is returned."""
    three = [*SWARM, "site-3"]
    sites = start_swarm(network, num_rounds=3, train_clients=three, aggr_clients=three, participants=three, **config)
    site_3 = network.open("site-3")
    trainer, aggregator = sites["site-1"].controller, sites["site-2"].controller
    trainer.roles.record_learn(0, "site-3")  # site-1 started the swarm
    assert aggregator.roles.learn_refusal("site-1", {"round": 0, "aggr": "site-3"}) is None
    for roles in (trainer.roles, aggregator.roles):
        assert roles.learn_refusal("site-3", {"round": 1, "aggr": "site-2"}) is None
    assert sites["site-2"].execute("swarm_lost", Shareable({LOST_KEY: ["site-3"]})).get_return_code() is ReturnCode.OK
    assert aggregator.give_up.round(1, "site-2", "site-3") is True
    return sites, site_3


def test_a_trainer_that_had_the_round_its_aggregation_client_gave_up_drops_it_and_the_job_goes_on(
    network: Network, caplog: pytest.LogCaptureFixture
) -> None:
    """site-1 hands site-2 its result of round 2, whose model site-2 never got whole: site-2 refuses
    it and has site-1 drop the round (a liar may not), so that both are back at round 1, which the
    server has played again; no one reports an error."""
    sites, site_3 = aggregator_gave_its_round_up(network)
    assert sites["site-1"].execute("swarm_lost", Shareable({LOST_KEY: ["site-3"]})).get_return_code() is ReturnCode.OK
    trainer = sites["site-1"].controller
    assert_refused(send(site_3, "site-1", "drop", {"round": 1}), "may not send a drop of round 2: the server lost it")
    outsider = network.open("site-2", name="site-2.other")  # a cell of the round's aggregation client may
    assert_refused(send(outsider, "site-1", "drop", {"round": 0}), "site-1 is not at round 1")
    assert trainer.roles.latest == (1, "site-2")

    with caplog.at_level(logging.WARNING, logger="engine.executors.ccwf"):
        reply = send(sites["site-1"].endpoint, "site-2", "result", {"round": 1, "ok": True})
        assert_refused(reply, "site-2 gave round 2 up: its model never came whole")
        status = sites["site-1"].wait_status("site-1 dropped round 2", lambda s: s.round == 0 and s.phase == "idle")
        wait_for_drop_askers("site-2")
        assert_refused(send(sites["site-1"].endpoint, "site-2", "result", {"round": 1, "ok": True}), "gave round 2 up")
        wait_for_drop_askers("site-2")

    assert status.aggr == "site-3"  # the round before, as the server judges the loss of site-3 by
    assert trainer.roles.latest == (0, "site-3")
    assert "round 2 dropped: its aggregation client site-2 never got its model whole" in caplog.text
    assert caplog.text.count("round 2 dropped at site-1 too") == 1  # a second result asked for no second drop
    assert sites["site-1"].errors() == [] and sites["site-2"].errors() == []


def test_a_trainer_that_cannot_drop_the_round_its_aggregation_client_gave_up_ends_the_job(network: Network) -> None:
    """As above, but site-1 never hears that the server lost site-3 (the sender of its round 2 model):
    it refuses to drop the round once it waited the time a loss takes to judge, and site-2 ends the
    job with the reason instead of leaving the swarm stalled."""
    sites, _ = aggregator_gave_its_round_up(network, status_interval=0.1)  # a loss judged within 2.3 s

    assert_refused(send(sites["site-1"].endpoint, "site-2", "result", {"round": 1, "ok": True}), "gave round 2 up")
    status = sites["site-2"].wait_status("site-2 ended the job", lambda s: bool(s.error))

    assert status.error.startswith(
        "site-2 could not receive round 2's model (its sender was lost) while the swarm went on with it: "
        "site-1 had it and handed in a result, and could not drop the round:"
    )
    assert "round 2's model came from site-3, which the server did not lose" in status.error
    assert sites["site-1"].controller.roles.latest == (1, "site-2")


def test_a_result_held_for_a_dropped_round_is_freed_when_the_round_before_comes_again(network: Network) -> None:
    """site-1's result of round 2, taken by site-2 before it gave the round up, stays offered for it
    to pull again until the round ends (held); once site-1 dropped the round, the round before's
    model coming again frees it, before site-1 trains that round (not a second model's worth kept)."""
    sites, _ = aggregator_gave_its_round_up(network)
    assert sites["site-1"].execute("swarm_lost", Shareable({LOST_KEY: ["site-3"]})).get_return_code() is ReturnCode.OK
    hand_in = sites["site-1"].controller.hand_in
    service = hand_in.codec.context.sending_service
    offers: list[str] = []
    result = DXO(DataKind.WEIGHTS, {"w": torch.ones(4, dtype=torch.float64)}, {"NUM_STEPS_CURRENT_ROUND": 1})
    hand_in.codec.encode(result.to_shareable(), receivers=["site-2"], offers=offers)
    service.hold(offers)
    hand_in._held.append((1, offers))  # as `submit` keeps a result its aggregation client may pull again
    assert_refused(send(sites["site-1"].endpoint, "site-2", "result", {"round": 1, "ok": True}), "gave round 2 up")
    sites["site-1"].wait_status("site-1 dropped round 2", lambda s: s.round == 0 and s.phase == "idle")
    offered = service.open_offers()  # still served: the learner frees it
    assert offers and offered >= len(offers)

    hand_in.drop_held(0)  # what the learner does first with round 1's model sent again

    assert service.open_offers() == offered - len(offers)
    assert service.drop(offers) == []  # none of them was open any more


def test_a_trainer_that_does_not_answer_a_drop_is_asked_again_until_the_server_loses_it(network: Network) -> None:
    """site-2 gave its round 2 up (site-1 sent its model and was lost); site-3 had it and hands in a
    result, but answers no drop (it stopped serving): site-2 asks again instead of ending the job,
    and stops asking once the server lost site-3 too."""
    three = [*SWARM, "site-3"]
    sites = start_swarm(
        network, num_rounds=3, submit_interval_s=0.2, train_clients=three, aggr_clients=three, participants=three
    )
    aggregator = sites["site-2"]
    assert aggregator.controller.roles.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
    assert aggregator.controller.roles.learn_refusal("site-1", {"round": 1, "aggr": "site-2"}) is None
    assert aggregator.execute("swarm_lost", Shareable({LOST_KEY: ["site-1"]})).get_return_code() is ReturnCode.OK
    assert aggregator.controller.give_up.round(1, "site-2", "site-1") is True
    site_3 = network.open("site-3")  # a trainer without a drop handler

    assert_refused(send(site_3, "site-2", "result", {"round": 1, "ok": True}), "gave round 2 up")
    time.sleep(1.0)  # asked again meanwhile, every 0.2 s
    assert aggregator.errors() == []
    lost = Shareable({LOST_KEY: ["site-1", "site-3"]})
    assert aggregator.execute("swarm_lost", lost).get_return_code() is ReturnCode.OK
    wait_for_drop_askers("site-2")  # its next try sees site-3 lost and stops

    assert aggregator.errors() == []
