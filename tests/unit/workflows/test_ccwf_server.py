"""The server side of client-controlled workflows against a real task queue, the test playing the
clients: config and start tasks, then the status reports that end the workflow, or fail it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from engine.controller import TaskQueue
from engine.controller.context import JobContext, ReceivedStatus
from engine.errors import WorkflowError
from engine.model import FLModel, ReturnCode, Shareable, make_reply, shareable_from_model
from engine.model.ccwf import CONFIG_KEY, GLOBAL_MODELS_KEY, WorkflowStatus
from engine.workflows.ccwf import CrossSiteEvalServerController, SwarmServerController
from engine.workflows.ccwf.cross_site_eval import RESULT_FILE
from engine.workflows.ccwf.server_side import _Following

CLIENTS = ["site-1", "site-2", "site-3"]


class Clients:
    """What the clients told the server: status reports, and the events the workflow reported."""

    def __init__(self) -> None:
        self.reports: dict[str, ReceivedStatus] = {}
        self.dead: set[str] = set()
        self.events: list[tuple[str, dict]] = []

    def status(self, site: str, **fields) -> None:
        self.reports[site] = ReceivedStatus(time.monotonic(), WorkflowStatus("swarm", **fields))

    def context(self, workspace: Path) -> JobContext:
        return JobContext(
            workspace=workspace,
            report=lambda event, **fields: self.events.append((event, fields)),
            status_reports=lambda workflow: dict(self.reports) if workflow == "swarm" else {},
            dead_clients=lambda: set(self.dead),
        )


@pytest.fixture
def start(tmp_path: Path):
    """Run a workflow in a thread against a real queue; yield (queue, clients, thread)."""
    queues = []

    def run(workflow) -> tuple[TaskQueue, Clients, threading.Thread]:
        queue = TaskQueue(CLIENTS)
        clients = Clients()
        clients.queue = queue  # type: ignore[attr-defined]
        workflow.bind(queue, context=clients.context(tmp_path))
        errors: list[BaseException] = []

        def target() -> None:
            try:
                workflow.run()
            except BaseException as e:  # noqa: BLE001 - handed to the test
                errors.append(e)

        thread = threading.Thread(target=target, daemon=True)
        thread.errors = errors  # type: ignore[attr-defined]
        thread.start()
        queues.append(queue)
        return queue, clients, thread

    yield run
    for queue in queues:
        queue.end_run()


def answer(queue: TaskQueue, site: str, task_name: str, result: Shareable | None = None) -> Shareable:
    """Take ``site``'s next task (it must be ``task_name``) and answer it OK; return its data."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assignment = queue.next_task(site)
        if assignment is not None:
            assert assignment.task_name == task_name
            reply = result if result is not None else make_reply(ReturnCode.OK)
            queue.submit(site, assignment.task_id, reply)
            return assignment.data
        time.sleep(0.01)
    raise AssertionError(f"{site} got no {task_name} task")


def configure_and_start(queue: TaskQueue, starter: str = "site-1") -> dict:
    configs = [answer(queue, site, "swarm_config") for site in CLIENTS]
    answer(queue, starter, "swarm_start")
    return configs[0][CONFIG_KEY]


def finish(thread: threading.Thread) -> list[BaseException]:
    thread.join(10)
    assert not thread.is_alive()
    return thread.errors  # type: ignore[attr-defined]


def test_swarm_configures_starts_and_ends_when_a_client_reports_all_done(start) -> None:
    queue, clients, thread = start(
        SwarmServerController(num_rounds=2, aggr_clients=["site-2", "site-3"], result_clients=["site-1"])
    )

    config = configure_and_start(queue)
    done = [{"round": 1, "time_s": 0.5, "metrics": {}, "clients": CLIENTS}, {"round": 0, "time_s": 1.0}]
    clients.status("site-2", round=1, phase="idle", progress=4, rounds_done=done)
    clients.status("site-3", round=1, phase="done", progress=7, all_done=True)

    assert finish(thread) == []
    assert config["aggr_clients"] == ["site-2", "site-3"] and config["train_clients"] == CLIENTS
    assert config["result_clients"] == ["site-1"] and config["num_rounds"] == 2
    rounds = [fields["round"] for event, fields in clients.events if event == "round_done"]
    assert rounds == [0, 1]  # once each, in order
    order = [(event, fields["round"]) for event, fields in clients.events if event in ("round_started", "round_done")]
    assert order == [("round_started", 0), ("round_done", 0), ("round_started", 1), ("round_done", 1)]


def test_only_an_aggregation_client_can_end_the_swarm_or_finish_a_round(
    start, caplog: pytest.LogCaptureFixture
) -> None:
    queue, clients, thread = start(SwarmServerController(num_rounds=2, aggr_clients=["site-2"]))

    configure_and_start(queue)
    lies = [{"round": 0, "time_s": 0.1}, {"round": 7, "time_s": 0.1}]
    clients.status("site-3", round=1, phase="done", progress=1, all_done=True, rounds_done=lies)
    clients.status("site-2", round=0, phase="train", progress=1, rounds_done=[{"round": 99, "time_s": 0.1}])
    time.sleep(1.5)  # three looks at the reports

    assert thread.is_alive()  # site-3 does not aggregate: its "done" changes nothing
    assert "'workflow done' report of site-3 ignored" in caplog.text
    assert [fields for event, fields in clients.events if event == "round_done"] == []
    clients.status("site-2", round=1, phase="done", progress=2, all_done=True, rounds_done=[{"round": 1}])
    assert finish(thread) == []
    assert [fields["round"] for event, fields in clients.events if event == "round_done"] == [1]


def test_a_client_error_ends_the_swarm_with_its_reason(start) -> None:
    queue, clients, thread = start(SwarmServerController(num_rounds=2))

    configure_and_start(queue)
    clients.status("site-2", round=0, error="round 0 on site-2: disk full")

    [error] = finish(thread)
    assert isinstance(error, WorkflowError) and "site-2 reported an error: round 0 on site-2: disk full" in str(error)


def test_no_progress_for_progress_timeout_ends_the_swarm(start) -> None:
    queue, clients, thread = start(SwarmServerController(num_rounds=2, progress_timeout=1.0))

    configure_and_start(queue)
    for site in CLIENTS:  # they keep reporting, but nothing moves
        clients.status(site, round=0, phase="training", progress=3)
    deadline = time.monotonic() + 5
    while thread.is_alive() and time.monotonic() < deadline:
        for site in CLIENTS:
            clients.status(site, round=0, phase="training", progress=3)
        time.sleep(0.1)

    [error] = finish(thread)
    assert "(progress_timeout=1 s)" in str(error) and "site-2: round 1 training" in str(error)


def test_a_dead_client_is_left_behind_while_min_clients_are_left(start) -> None:
    queue, clients, thread = start(SwarmServerController(num_rounds=2, min_clients=2, max_status_report_interval=30))

    configure_and_start(queue)
    clients.dead.add("site-3")
    time.sleep(1.0)
    assert thread.is_alive()  # two of three left: it goes on
    clients.dead.add("site-2")

    [error] = finish(thread)
    assert "too few clients left: site-2, site-3 lost" in str(error) and "min_clients=2" in str(error)
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert "site-3 stopped answering; going on without it" in notes


def next_task_but_lost(queue: TaskQueue, site: str):
    """``site``'s next task that is not a ``swarm_lost`` notice (those are answered OK); None when none is there."""
    while (assignment := queue.next_task(site)) is not None and assignment.task_name == "swarm_lost":
        queue.submit(site, assignment.task_id, make_reply(ReturnCode.OK))
    return assignment


ROUND_1 = [{"round": 0, "time_s": 1.0, "metrics": {}, "clients": CLIENTS, "aggregator": "site-1"}]


def replay_asked_of_site_1(clients: Clients, report) -> None:
    """Report site-1 (round 1's aggregation client) and site-3 idle at round 2, whose aggregation
    client site-2 is lost, until site-1 is told to send round 2's model again without site-2; answer it OK."""
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        clients.status("site-1", round=1, aggr="site-2", phase="idle", progress=6, rounds_done=ROUND_1)
        report(1, "site-2", **{"site-3": "idle"})
        replay = next_task_but_lost(clients.queue, "site-1")
        if replay is not None:
            assert replay.task_name == "swarm_replay"
            assert (replay.data["round"], replay.data["exclude"]) == (1, ["site-2"])
            clients.queue.submit("site-1", replay.task_id, make_reply(ReturnCode.OK))
            return
        time.sleep(0.1)
    raise AssertionError("site-1 was not told to send round 2's model again")


def swarm_to_follow(start, num_rounds: int = 4):
    queue, clients, thread = start(
        SwarmServerController(
            num_rounds=num_rounds, aggr_clients=["site-1", "site-2"], min_clients=1, max_status_report_interval=3
        )
    )  # reports every second: a loss is judged 2 s after it
    configure_and_start(queue)

    def report(round_: int, aggr: str, **phases: str) -> None:
        for site, phase in phases.items():
            clients.status(site, round=round_, aggr=aggr, phase=phase, progress=round_)

    def keep_reporting(seconds: float, round_: int, aggr: str, **phases: str) -> None:
        deadline = time.monotonic() + seconds
        while thread.is_alive() and time.monotonic() < deadline:
            report(round_, aggr, **phases)
            time.sleep(0.1)

    return clients, thread, report, keep_reporting


def test_losing_the_rounds_aggregation_client_ends_the_swarm_once_the_others_had_time_to_report(start) -> None:
    """site-2 aggregates round 2 (the clients' reports say so) and is lost: nobody else can finish
    that round, and the swarm ends naming it instead of waiting out the progress timeout. site-1,
    lost as round 2 got under way (its round 1 was over), was left behind."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    report(0, "site-1", **{"site-1": "aggregating", "site-2": "training", "site-3": "training"})
    clients.dead.add("site-1")
    keep_reporting(3.0, 1, "site-2", **{"site-2": "aggregating", "site-3": "training"})
    assert thread.is_alive()  # site-1 was judged: the round it held was over
    clients.dead.add("site-2")
    started = time.monotonic()
    keep_reporting(5.0, 1, "site-2", **{"site-3": "idle"})  # site-3 handed its result to site-2

    [error] = finish(thread)
    assert 1.5 < time.monotonic() - started < 4
    assert (
        "site-2 is lost (stopped answering), and it aggregates round 2 (as site-3 reported), "
        "which no other client can finish; no client left holds round 2's model to play it again" in str(error)
    )


def test_a_lost_rounds_aggregation_client_has_the_round_played_again_by_the_previous_one(start) -> None:
    """site-2 aggregates round 2 and is lost; site-1 reported round 1 done: it is told to send round
    2's model again, without site-2, and the swarm goes on to its end."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    clients.status("site-1", round=1, aggr="site-2", phase="training", progress=5, rounds_done=ROUND_1)
    report(1, "site-2", **{"site-2": "aggregating", "site-3": "training"})
    clients.dead.add("site-2")
    replay_asked_of_site_1(clients, report)
    clients.dead.discard("site-2")  # it comes back, and says it finished the swarm on its own
    keep_reporting(1.5, 1, "site-2", **{"site-2": "done"})
    clients.status("site-2", round=3, aggr="site-2", phase="done", progress=99, all_done=True)
    keep_reporting(1.5, 1, "site-1", **{"site-1": "aggregating", "site-3": "training"})
    assert thread.is_alive()  # the swarm went on without it: what it says is not heard
    clients.status("site-1", round=1, aggr="site-1", phase="done", progress=9, all_done=True)
    assert finish(thread) == []
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert any("site-1 sent round 2's model again, to another aggregation client" in note for note in notes), notes


@pytest.mark.slow  # 5 s in real time; CI runs it with -m slow (the quick first-round cases stay)
def test_a_lost_starting_client_has_the_first_aggregation_client_left_play_round_1_once_every_client_left_knows(
    start,
) -> None:
    """site-1 started the swarm and aggregates round 1, and is lost. site-2, the first aggregation
    client left, is told to send round 1's model again (it reads the starting checkpoint), but only
    once site-2 and site-3 answered that site-1 is lost: a client takes round 1's model from another
    than the starting client only then."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    queue = clients.queue
    training = {"site-2": "training", "site-3": "training"}
    report(0, "site-1", **{"site-1": "aggregating"}, **training)
    clients.dead.add("site-1")
    held: list = []  # site-3's lost notices, not answered yet
    replay = None
    deadline = time.monotonic() + 8
    while replay is None and len(held) < 2 and time.monotonic() < deadline:
        report(0, "site-1", **training)
        replay = next_task_but_lost(queue, "site-2")
        if (notice := queue.next_task("site-3")) is not None:
            assert (notice.task_name, notice.data["lost"]) == ("swarm_lost", ["site-1"])
            held.append(notice)
        time.sleep(0.05)
    assert replay is None and len(held) == 2  # told when judged, then who sends round 1 again
    assert "starts_again" not in held[0].data and held[1].data["starts_again"] == "site-2"
    keep_reporting(1.0, 0, "site-1", **training)
    assert next_task_but_lost(queue, "site-2") is None  # site-3 has not answered yet
    for notice in held:
        queue.submit("site-3", notice.task_id, make_reply(ReturnCode.OK))
    deadline = time.monotonic() + 3
    while (replay := next_task_but_lost(queue, "site-2")) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replay is not None and replay.task_name == "swarm_replay"
    assert (replay.data["round"], replay.data["exclude"]) == (0, ["site-1"])
    queue.submit("site-2", replay.task_id, make_reply(ReturnCode.OK))
    keep_reporting(0.5, 0, "site-2", **training)
    clients.status("site-2", round=3, aggr="site-2", phase="done", progress=20, all_done=True)
    assert finish(thread) == []
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert any("site-2 sent round 1's model again, to another aggregation client" in note for note in notes), notes


def test_a_starting_client_lost_before_any_client_took_round_1_has_it_played_again(start) -> None:
    """site-1 started the swarm and died sending round 1's model: site-2 and site-3 gave it up (they
    report no round). site-2 is told to send round 1's model again without site-1."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    report(0, "site-1", **{"site-1": "aggregating"})
    clients.dead.add("site-1")
    deadline = time.monotonic() + 8
    while (replay := next_task_but_lost(clients.queue, "site-2")) is None and time.monotonic() < deadline:
        report(-1, "", **{"site-2": "idle", "site-3": "idle"})
        next_task_but_lost(clients.queue, "site-3")
        time.sleep(0.05)
    assert replay is not None and replay.task_name == "swarm_replay", thread.errors  # type: ignore[attr-defined]
    assert (replay.data["round"], replay.data["exclude"]) == (0, ["site-1"])
    clients.queue.submit("site-2", replay.task_id, make_reply(ReturnCode.OK))
    clients.status("site-2", round=3, aggr="site-2", phase="done", progress=20, all_done=True)
    assert finish(thread) == []
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert any("it started the swarm, and no other client has round 1's model" in note for note in notes), notes


@pytest.mark.parametrize("dead", [True, False], ids=["it died", "it failed"])
def test_a_start_task_ended_by_the_starting_clients_death_is_followed_as_a_loss_that_is_never_taken_back(
    start, dead: bool
) -> None:
    """site-1 takes its start task and dies (the runtime ends the task CLIENT_DEAD): the server
    follows the swarm, judges site-1 lost (though it reports again: it never started the swarm) and
    has site-2 send round 1's model. A start task that site-1 answers with an error ends the swarm."""
    queue, clients, thread = start(SwarmServerController(num_rounds=2, min_clients=1, max_status_report_interval=3))
    for site in CLIENTS:
        answer(queue, site, "swarm_config")
    if not dead:
        answer(queue, "site-1", "swarm_start", make_reply(ReturnCode.EXECUTION_EXCEPTION))
        [error] = finish(thread)
        assert "swarm_start failed on site-1" in str(error)
        return
    deadline = time.monotonic() + 10
    while queue.next_task("site-1") is None:  # taken, never answered
        assert time.monotonic() < deadline
        time.sleep(0.01)
    clients.dead.add("site-1")
    queue.client_dead("site-1")
    time.sleep(0.5)
    clients.dead.discard("site-1")  # back at once (a brief loss of its link), reporting as configured
    idle = {"site-1": "configured", "site-2": "configured", "site-3": "configured"}
    replay_of_round_1(clients, "site-2", idle)
    clients.status("site-2", round=1, aggr="site-2", phase="done", progress=20, all_done=True)
    assert finish(thread) == []
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert "site-1 died starting the workflow (dead); its loss is judged like any other" in notes, notes
    assert any("site-1 died starting the workflow (dead) and it started the swarm" in note for note in notes), notes


@pytest.mark.slow  # 6 s in real time; CI runs it with -m slow
def test_the_client_sending_round_1_again_lost_before_any_client_took_it_has_the_next_one_send_it(start) -> None:
    """site-1 (starting client) is lost before any client took round 1's model; site-2 is told to
    send it again, and is lost too before any client took it: site-3, the next aggregation
    client left, is named to the clients left and told to send it again."""
    clients, thread, report = start_three_aggregators(start)
    clients.dead.add("site-1")
    replay = replay_of_round_1(clients, "site-2", {"site-2": "idle", "site-3": "idle"})
    assert replay.data["exclude"] == ["site-1"]
    clients.dead.add("site-2")
    told: list = []
    deadline = time.monotonic() + 8
    while (again := clients.queue.next_task("site-3")) is None or again.task_name == "swarm_lost":
        assert time.monotonic() < deadline, thread.errors  # type: ignore[attr-defined]
        if again is not None:
            told.append(again.data.get("starts_again"))
            clients.queue.submit("site-3", again.task_id, make_reply(ReturnCode.OK))
        report(-1, "", **{"site-3": "idle"})
        time.sleep(0.05)
    assert told[-1] == "site-3"
    assert again.task_name == "swarm_replay" and (again.data["round"], again.data["exclude"]) == (
        0,
        ["site-1", "site-2"],
    )
    clients.queue.submit("site-3", again.task_id, make_reply(ReturnCode.OK))
    clients.status("site-3", round=3, aggr="site-3", phase="done", progress=20, all_done=True)
    assert finish(thread) == []
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert any("it was sending round 1's model again, and no other client has it" in note for note in notes), notes


def start_three_aggregators(start):
    queue, clients, thread = start(
        SwarmServerController(num_rounds=4, min_clients=1, max_status_report_interval=3)
    )  # every client aggregates; reports every second: a loss is judged 2 s after it
    configure_and_start(queue)

    def report(round_: int, aggr: str, **phases: str) -> None:
        for site, phase in phases.items():
            clients.status(site, round=round_, aggr=aggr, phase=phase, progress=round_)

    return clients, thread, report


def replay_of_round_1(clients: Clients, site: str, idle: dict[str, str]):
    """Report ``idle`` at no round until ``site`` is told to send round 1's model again; answer it OK."""
    deadline = time.monotonic() + 8
    while (replay := next_task_but_lost(clients.queue, site)) is None:
        assert time.monotonic() < deadline, f"{site} was not told to send round 1's model again"
        for other, phase in idle.items():
            clients.status(other, round=-1, aggr="", phase=phase, progress=0)
            if other != site:
                next_task_but_lost(clients.queue, other)
        time.sleep(0.05)
    assert replay.task_name == "swarm_replay" and replay.data["round"] == 0
    clients.queue.submit(site, replay.task_id, make_reply(ReturnCode.OK))
    return replay


def test_an_aggregation_client_lost_with_the_next_rounds_model_has_its_finished_round_played_again(start) -> None:
    """site-2 reported round 2 done and was lost before round 3's model reached anyone (every other
    client still reports round 2): site-1, round 1's aggregation client, is told to send round 2's
    model again, and round 2's "done" from the one that plays it is reported again."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    round_2 = [{"round": 1, "time_s": 1.0, "metrics": {}, "clients": CLIENTS, "aggregator": "site-2"}]
    clients.status("site-2", round=1, aggr="site-2", phase="idle", progress=9, rounds_done=round_2)
    clients.dead.add("site-2")
    replay_asked_of_site_1(clients, report)
    again = [{"round": 1, "time_s": 2.0, "metrics": {}, "clients": ["site-1", "site-3"], "aggregator": "site-1"}]
    clients.status("site-1", round=1, aggr="site-1", phase="idle", progress=12, rounds_done=ROUND_1 + again)
    time.sleep(1.0)
    clients.status("site-1", round=3, aggr="site-1", phase="done", progress=20, all_done=True)
    assert finish(thread) == []
    done = [fields for event, fields in clients.events if event == "round_done" and fields["round"] == 1]
    assert [(entry["aggregator"], entry.get("played_again")) for entry in done] == [("site-2", None), ("site-1", True)]
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert any(
        "it aggregated round 2 (as site-1, site-3 reported) and was the only client with its next round" in n
        for n in notes
    ), notes


LAST_ROUND_DONE = [{"round": 1, "time_s": 1.0, "metrics": {}, "clients": CLIENTS, "aggregator": "site-2"}]


def test_a_swarm_whose_last_aggregation_client_is_lost_after_every_result_client_saved_the_final_model_is_done(
    start,
) -> None:
    clients, thread, report, keep_reporting = swarm_to_follow(start, num_rounds=2)
    clients.status("site-2", round=1, aggr="site-2", phase="idle", progress=9, rounds_done=LAST_ROUND_DONE)
    clients.dead.add("site-2")  # before it reported the swarm done
    keep_reporting(6.0, 1, "site-2", **{"site-1": "done", "site-3": "done"})

    assert finish(thread) == []
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert "swarm done: the final model is with every result client left (site-1, site-3)" in notes, notes


def test_a_final_model_that_some_result_clients_saved_is_not_made_again(start) -> None:
    clients, thread, report, keep_reporting = swarm_to_follow(start, num_rounds=2)
    clients.status("site-2", round=1, aggr="site-2", phase="idle", progress=9, rounds_done=LAST_ROUND_DONE)
    clients.dead.add("site-2")
    keep_reporting(6.0, 1, "site-2", **{"site-1": "done", "site-3": "idle"})

    [error] = finish(thread)
    assert (
        "site-2 is lost (stopped answering), and it aggregated the last round (as site-1, site-3 reported) and "
        "was sending the final model, which site-1 saved but not site-3; a final model that some result clients "
        "saved cannot be made again" in str(error)
    )
    assert next_task_but_lost(clients.queue, "site-1") is None  # no replay


def test_a_round_finished_by_a_lost_client_whose_next_model_reached_someone_or_finished_by_another_goes_on(
    start,
) -> None:
    """site-2 reported round 2 done and is lost, but site-1 and site-3 report round 3 (its model left
    site-2): the loss costs nothing, and no round is played again."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    round_2 = [{"round": 1, "time_s": 1.0, "metrics": {}, "clients": CLIENTS, "aggregator": "site-2"}]
    clients.status("site-2", round=1, aggr="site-2", phase="idle", progress=9, rounds_done=round_2)
    clients.dead.add("site-2")
    keep_reporting(4.0, 2, "site-1", **{"site-1": "aggregating", "site-3": "training"})
    assert thread.is_alive()
    assert next_task_but_lost(clients.queue, "site-1") is None  # no replay
    clients.status("site-1", round=3, aggr="site-1", phase="done", progress=20, all_done=True)
    assert finish(thread) == []


def test_the_final_model_with_every_result_client_left_ends_the_swarm_done_though_one_was_lost_before(start) -> None:
    clients, thread, report, keep_reporting = swarm_to_follow(start, num_rounds=2)
    clients.dead.add("site-3")  # a result client, lost for good first
    keep_reporting(2.5, 1, "site-2", **{"site-1": "training", "site-2": "aggregating"})
    clients.status("site-2", round=1, aggr="site-2", phase="idle", progress=9, rounds_done=LAST_ROUND_DONE)
    clients.dead.add("site-2")
    keep_reporting(6.0, 1, "site-2", **{"site-1": "done"})

    assert finish(thread) == []
    notes = [fields["message"] for event, fields in clients.events if event == "workflow_note"]
    assert "swarm done: the final model is with every result client left (site-1)" in notes, notes


def test_a_round_whose_next_model_its_receivers_give_up_after_its_sender_is_lost_is_played_again(start) -> None:
    """site-2 reported round 2 done and died as site-1 and site-3 pulled round 3's model from it:
    judged, its loss costs nothing (they report round 3); once they give round 3 up and report
    round 2 again, site-1 is told to send round 2's model again."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    round_2 = [{"round": 1, "time_s": 1.0, "metrics": {}, "clients": CLIENTS, "aggregator": "site-2"}]
    clients.status("site-2", round=2, aggr="site-2", phase="receiving", progress=9, rounds_done=round_2)
    clients.dead.add("site-2")
    keep_reporting(3.0, 2, "site-1", **{"site-1": "receiving", "site-3": "receiving"})
    assert thread.is_alive() and next_task_but_lost(clients.queue, "site-1") is None

    replay_asked_of_site_1(clients, report)
    clients.status("site-1", round=3, aggr="site-1", phase="done", progress=20, all_done=True)
    assert finish(thread) == []


def test_a_lost_clients_own_report_of_a_later_round_does_not_move_the_round_its_loss_is_judged_by(start) -> None:
    """site-2 aggregated round 2 and sent round 3's model to itself first (it aggregates round 3
    too: site-1's turn was skipped), then died: the others still report round 2, so round 2 is
    played again."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    round_2 = [{"round": 1, "time_s": 1.0, "metrics": {}, "clients": CLIENTS, "aggregator": "site-2"}]
    clients.status("site-2", round=2, aggr="site-2", phase="aggregating", progress=9, rounds_done=round_2)
    clients.dead.add("site-2")
    replay_asked_of_site_1(clients, report)
    clients.status("site-1", round=3, aggr="site-1", phase="done", progress=20, all_done=True)
    assert finish(thread) == []


def test_a_replays_sender_lost_before_any_client_took_its_model_ends_the_swarm_naming_it(start) -> None:
    """site-2 is lost aggregating round 2; site-1 is told to send round 2's model again and is lost
    before any client took it (all still name site-2): no client holds that model any more."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    clients.status("site-1", round=1, aggr="site-2", phase="training", progress=5, rounds_done=ROUND_1)
    report(1, "site-2", **{"site-2": "aggregating", "site-3": "training"})
    clients.dead.add("site-2")
    replay_asked_of_site_1(clients, report)
    clients.dead.add("site-1")

    keep_reporting(6.0, 1, "site-2", **{"site-3": "idle"})
    [error] = finish(thread)
    assert (
        "site-1 is lost (stopped answering), and it was sending round 2's model again, which site-3 did not "
        "take yet; no client left holds round 2's model to play it again" in str(error)
    )


def test_the_clients_left_are_told_whom_the_swarm_lost_once_it_is_judged(start) -> None:
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    queue = clients.queue
    phases = {"site-1": "aggregating", "site-2": "training"}
    keep_reporting(0.5, 1, "site-1", **phases, **{"site-3": "training"})
    clients.dead.add("site-3")
    keep_reporting(1.0, 1, "site-1", **phases)
    assert queue.next_task("site-1") is None  # not judged yet

    told = {}
    deadline = time.monotonic() + 5
    while len(told) < 2 and time.monotonic() < deadline:
        report(1, "site-1", **phases)
        for site in ("site-1", "site-2"):
            task = queue.next_task(site)
            if task is not None:
                told[site] = (task.task_name, task.data["lost"])
                queue.submit(site, task.task_id, make_reply(ReturnCode.OK))
        time.sleep(0.1)

    assert told == {"site-1": ("swarm_lost", ["site-3"]), "site-2": ("swarm_lost", ["site-3"])}
    assert queue.next_task("site-3") is None
    clients.status("site-1", round=3, aggr="site-1", phase="done", progress=20, all_done=True)
    assert finish(thread) == []


@pytest.mark.slow  # waits out three judgements in real time (9 s); CI runs it with -m slow
def test_a_lost_client_whose_turn_was_skipped_or_that_came_back_does_not_end_the_swarm(start) -> None:
    """Round 2 was site-2's turn, but site-2 did not answer and site-1 took it (the round's model
    says so): losing site-2 leaves round 2 to site-1. A client lost for a moment and back is not judged."""
    clients, thread, report, keep_reporting = swarm_to_follow(start)
    keep_reporting(0.5, 1, "site-1", **{"site-1": "aggregating", "site-2": "training", "site-3": "training"})
    clients.dead.add("site-2")
    keep_reporting(3.0, 1, "site-1", **{"site-1": "aggregating", "site-3": "training"})
    assert thread.is_alive()

    clients.dead.add("site-1")  # gone for a moment, then back and reporting
    time.sleep(0.3)
    clients.dead.discard("site-1")
    keep_reporting(3.0, 1, "site-1", **{"site-1": "aggregating", "site-3": "idle"})
    assert thread.is_alive()

    clients.dead.add("site-1")  # lost for good this time: judged, though lost once before
    started = time.monotonic()
    keep_reporting(6.0, 1, "site-1", **{"site-3": "idle"})
    [error] = finish(thread)
    assert time.monotonic() - started < 4
    # site-2, lost for good before, is not heard: site-3 alone says who aggregates the round
    assert "site-1 is lost (stopped answering), and it aggregates round 2 (as site-3 reported)" in str(error)


def test_a_failed_config_task_ends_the_swarm_naming_the_client(start) -> None:
    queue, clients, thread = start(SwarmServerController(num_rounds=1))

    failure = make_reply(ReturnCode.EXECUTION_EXCEPTION)
    failure.set_header("reason", "no component with id 'aggregator'")
    answer(queue, "site-1", "swarm_config")
    answer(queue, "site-2", "swarm_config", failure)
    answer(queue, "site-3", "swarm_config")

    [error] = finish(thread)
    assert "swarm_config failed" in str(error) and "site-2: ERROR: no component with id 'aggregator'" in str(error)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"aggr_clients": ["site-9"]}, "aggr_clients: site-9 not among the participating clients"),
        ({"participating_clients": ["site-1", "site-7"]}, "participating_clients: site-7 not among the job's clients"),
        ({"starting_client": "site-4", "participating_clients": ["site-1"]}, "starting_client 'site-4'"),
    ],
)
def test_unknown_clients_in_the_args_are_named(start, args: dict, message: str) -> None:
    queue, clients, thread = start(SwarmServerController(num_rounds=1, **args))

    [error] = finish(thread)
    assert message in str(error)


def metrics_reply(value: float) -> Shareable:
    reply = shareable_from_model(FLModel(metrics={"accuracy": value}))
    reply.set_return_code(ReturnCode.OK)
    return reply


def test_cross_site_eval_fills_the_matrix_and_writes_it(start, tmp_path: Path) -> None:
    queue, clients, thread = start(CrossSiteEvalServerController(evaluatees=["site-2"], global_model_client="site-1"))

    holder = Shareable({GLOBAL_MODELS_KEY: ["global"]})
    holder.set_return_code(ReturnCode.OK)
    for site in CLIENTS:
        answer(queue, site, "cse_config", holder if site == "site-1" else None)
    models = []
    for _ in range(2):  # the global model, then site-2's
        for k, site in enumerate(CLIENTS, 1):
            if site == "site-3" and not models:  # site-3 fails the global model
                failure = make_reply(ReturnCode.EXECUTION_EXCEPTION)
                failure.set_header("reason", "validation data missing")
                data = answer(queue, site, "cse_eval", failure)
            else:
                data = answer(queue, site, "cse_eval", metrics_reply(k / 10))
        models.append(data["model_name"])

    assert finish(thread) == []
    assert models == ["global", "local"]
    matrix = json.loads((tmp_path / RESULT_FILE).read_text())
    assert matrix == {
        "site-1": {"global (site-1)": {"accuracy": 0.1}, "site-2": {"accuracy": 0.1}},
        "site-2": {"global (site-1)": {"accuracy": 0.2}, "site-2": {"accuracy": 0.2}},
        "site-3": {"global (site-1)": {"error": "ERROR: validation data missing"}, "site-2": {"accuracy": 0.3}},
    }
    [(event, fields)] = [(e, f) for e, f in clients.events if e == "cross_site_val"]
    assert fields["matrix"] == matrix


def test_cross_site_eval_refuses_nothing_to_evaluate() -> None:
    with pytest.raises(ValueError, match="cannot both be '@none'"):
        CrossSiteEvalServerController(evaluatees="@none", global_model_client="@none")


def test_a_status_survives_its_header_and_a_malformed_one_is_refused() -> None:
    status = WorkflowStatus("swarm", round=3, phase="training", progress=9, rounds_done=[{"round": 2}])

    assert WorkflowStatus.from_header(status.to_header()) == status
    with pytest.raises(ValueError, match="malformed workflow status"):
        WorkflowStatus.from_header({"round": 1})


def test_clients_lost_at_the_same_look_are_each_judged_with_their_own_reason() -> None:
    """site-1 (round 2's aggregation client) stopped answering and site-2 fell silent, both noted at
    the same look: judged together two status intervals later, the swarm ends naming site-1 with its
    own reason, not site-2's."""
    workflow = SwarmServerController(
        num_rounds=4, aggr_clients=["site-1", "site-2"], min_clients=1, max_status_report_interval=3
    )
    queue = TaskQueue(CLIENTS)
    workflow.bind(queue, context=JobContext())
    now = time.monotonic()
    phases = {"site-1": "aggregating", "site-2": "training", "site-3": "idle"}
    statuses = {
        site: WorkflowStatus("swarm", round=1, aggr="site-1", phase=p, progress=1) for site, p in phases.items()
    }
    reports = {site: ReceivedStatus(now - 10, status) for site, status in statuses.items()}
    state = _Following(started=now - 20, lost={"site-1", "site-2"})
    state.unjudged.update({"site-1": (now - 2, "stopped answering"), "site-2": (now - 2, "sent no status for 10 s")})
    try:
        with pytest.raises(WorkflowError) as raised:
            workflow._judge_lost(state, CLIENTS, statuses, reports, {"site-1"}, now)
    finally:
        queue.end_run()

    assert "site-1 is lost (stopped answering), and it aggregates round 2 (as site-2, site-3 reported)" in str(
        raised.value
    )
    assert state.gone == {"site-1", "site-2"}
