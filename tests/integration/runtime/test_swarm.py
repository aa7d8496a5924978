"""Swarm learning and cross-site evaluation in real jobs: the analytic model with download_to_disk
on and off, the cross-site matrix, and the faults (a trainer killed mid-upload, the aggregation
client dying, progress stalling, an evaluator failing one validation)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import job_code_on_path
from engine.fault_points import FAULT_POINT_ENV
from engine.runtime.states import JobState
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import (
    expected_delta,
    in_background,
    kill_when_a_download_starts,
    make_swarm_job,
    pids_of,
)

REPO = Path(__file__).resolve().parents[3]
SITES = ["site-1", "site-2", "site-3"]


def initial_model(job: Path, layers: int, width: int) -> dict[str, torch.Tensor]:
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        return {name: t.detach().clone() for name, t in BenchNet(layers=layers, width=width).state_dict().items()}


def final_model(workspace: Path, site: str) -> dict[str, torch.Tensor]:
    return load_file(workspace / site / "models" / "global.safetensors")


def assert_moved_by(final: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], delta: float) -> None:
    for name, tensor in initial.items():
        assert torch.allclose(final[name].double(), tensor.double() + delta, rtol=0, atol=1e-6), name


def assert_rounds_that_counted(
    workspace: Path, sites: tuple[str, ...], initial: dict[str, torch.Tensor], rounds: list[dict], num_clients: int
) -> None:
    """Each of ``sites`` ends with the exact model of the rounds in ``summary.json``, each moved by
    the clients that counted in it."""
    deltas = [expected_delta(num_clients, [int(site[-1]) for site in entry["clients"]]) for entry in rounds]
    for site in sites:
        assert_moved_by(final_model(workspace, site), initial, sum(deltas))


def downloads_left(workspace: Path) -> list[Path]:
    return [path for site in SITES for path in (workspace / site / "downloads").glob("**/*")]


@pytest.mark.parametrize("on", [False, True], ids=["disk-off", "disk-on"])
def test_the_swarm_model_is_fedavgs_on_and_off_and_no_file_is_left(simulate, tmp_path: Path, on: bool) -> None:
    job = make_swarm_job(tmp_path, num_rounds=2, width=64, controller_args={"download_to_disk": on})
    initial = initial_model(job, 2, 64)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    workspace = tmp_path / "workspace"
    for site in SITES:  # every result client has the final model: two rounds of FedAvg's update
        assert_moved_by(final_model(workspace, site), initial, 2 * expected_delta(3))
    summary = read_json(workspace / "summary.json")
    assert [(r["round"], r["aggregator"], r["clients"]) for r in summary["rounds"]] == [
        (1, "site-1", SITES),  # rounds counted from 1, as the console shows them
        (2, "site-2", SITES),
    ]
    assert downloads_left(workspace) == []
    log = (workspace / "site-1" / "log.txt").read_text()  # site-1 aggregates round 1
    if on:
        assert "downloads go to disk" in log
    # In memory every result is folded chunk by chunk (the final model is the same, 1e-6).
    assert f"round aggregated round=1 results=3 folded={0 if on else 3}" in log, log[-3000:]
    server_rss = summary["processes"]["server"]["peak_rss_mb"]
    assert server_rss < 500, "the server never holds a model"


def test_cross_site_matrix_has_every_model_and_the_one_failed_validation(simulate, tmp_path: Path) -> None:
    job = make_swarm_job(
        tmp_path, num_rounds=2, cross_site_eval=True, validator_args={"fail_site": "site-2", "fail_call": 2}
    )
    initial = initial_model(job, 2, 32)
    start_mean = torch.cat([t.double().flatten() for t in initial.values()]).mean().item()

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    matrix = read_json(tmp_path / "workspace" / "server" / "cross_site_val.json")
    models = ["global (site-1)", *SITES]
    assert sorted(matrix) == SITES and all(sorted(row) == sorted(models) for row in matrix.values())
    # Each site's own model: the last round's start (one round of updates) plus its own step.
    expected = {"global (site-1)": start_mean + 2 * expected_delta(3)}
    expected |= {site: start_mean + expected_delta(3) + k * 0.001 for k, site in enumerate(SITES, 1)}
    failed = [(site, model) for site, row in matrix.items() for model, cell in row.items() if "error" in cell]
    assert failed == [("site-2", "site-1")], matrix  # site-2's second validation: site-1's model
    assert "injected validation failure on site-2" in matrix["site-2"]["site-1"]["error"]
    for site, row in matrix.items():
        for model, cell in row.items():
            if (site, model) not in failed:
                assert cell["mean"] == pytest.approx(expected[model], abs=1e-6), (site, model)
    assert "cross-site evaluation (mean; rows: evaluators, columns: models)" in output
    assert "error" in output.split("cross-site evaluation")[-1]


BIG = {"layers": 1, "width": 2048, "chunk_bytes": 16384}  # 16 MiB in 16 KiB chunks: a slow upload


def test_a_trainer_killed_mid_upload_leaves_the_round_to_the_others(simulate, tmp_path: Path) -> None:
    job = make_swarm_job(
        tmp_path,
        num_rounds=2,
        swarm_args={"min_clients": 2},
        controller_args={"download_to_disk": True, "min_responses_required": 2, "learn_task_ack_timeout": 5},
        **BIG,
    )
    initial = initial_model(job, 1, 2048)
    aggregator_downloads = tmp_path / "workspace" / "site-1" / "downloads"  # round 0's aggregation client
    finished = in_background(simulate, job)

    killed = kill_when_a_download_starts(aggregator_downloads, str(tmp_path), "--site site-3")
    result, output = finished()

    assert killed, output
    assert result.state is JobState.FINISHED_COMPLETED, output
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert rounds[-1]["clients"] == ["site-1", "site-2"]
    assert_rounds_that_counted(tmp_path / "workspace", ("site-1", "site-2"), initial, rounds, 3)
    assert "site-3 stopped answering" in output
    assert [
        p for site in ("site-1", "site-2") for p in (tmp_path / "workspace" / site / "downloads").glob("**/*")
    ] == []


def test_a_dead_aggregation_client_costs_its_round_which_another_plays_again(simulate, tmp_path: Path) -> None:
    """site-2 aggregates round 2 and dies as it starts training it: the server judges the loss,
    site-1 (round 1's aggregation client) sends round 2's model again, site-3 aggregates it from
    the two left, and the job completes with the model of those rounds."""
    job = make_swarm_job(
        tmp_path,
        num_rounds=2,
        script_args="--fault kill --fault-site site-2 --fault-round 1",
        swarm_args={"min_clients": 2},
        controller_args={"min_responses_required": 2, "request_to_submit_result_interval": 0.5},
    )
    initial = initial_model(job, 2, 32)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert [(entry["round"], entry["aggregator"]) for entry in rounds] == [(1, "site-1"), (2, "site-3")]
    assert rounds[1]["clients"] == ["site-1", "site-3"]  # played again without site-2
    assert "site-1 sent round 2's model again, to another aggregation client" in output
    assert_rounds_that_counted(tmp_path / "workspace", ("site-1", "site-3"), initial, rounds, 3)


def write_starting_checkpoint(job: Path, layers: int, width: int) -> dict[str, torch.Tensor]:
    """Write the job's starting checkpoint (``starting.safetensors``, BenchNet's weights + 1, so not
    the module's own) in its app folder; return it."""
    start = {name: tensor + 1.0 for name, tensor in initial_model(job, layers, width).items()}
    save_file(start, job / "app" / "starting.safetensors")
    return start


def assert_site_1s_rounds_played_by_site_2_and_site_3(
    workspace: Path, start: dict[str, torch.Tensor], second_aggregator: str = "site-2"
) -> None:
    """Both rounds of the job were played by site-2 and site-3 (site-1 lost in round 1), round 1
    aggregated by site-2: they end with the starting checkpoint moved by those rounds."""
    rounds = read_json(workspace / "summary.json")["rounds"]
    assert [(entry["round"], entry["aggregator"], entry["clients"]) for entry in rounds] == [
        (1, "site-2", ["site-2", "site-3"]),
        (2, second_aggregator, ["site-2", "site-3"]),
    ]
    assert_rounds_that_counted(workspace, ("site-2", "site-3"), start, rounds, 3)


@pytest.mark.slow  # end to end; CI runs it with -m slow (the roles: test_swarm_roles.py)
@pytest.mark.parametrize("checkpoint", [True, False], ids=["from a checkpoint", "from the module"])
def test_a_starting_client_lost_in_the_first_round_costs_the_round_which_another_plays_from_the_checkpoint(
    simulate, tmp_path: Path, checkpoint: bool
) -> None:
    """site-1 starts the swarm and aggregates round 1; site-2 and site-3 hold round 1's model
    whole, and site-1 dies (SIGKILL). The server tells site-2 and site-3, then has site-2 (the
    first aggregation client left) play round 1 again from the starting checkpoint, which it
    aggregates: the job completes with the checkpoint's weights moved by the rounds that counted,
    instead of ending for want of round 1's model. Started from the module's own weights (no
    checkpoint), nobody has them any more: the job ends saying what to configure."""
    workspace = tmp_path / "workspace"
    job = make_swarm_job(
        tmp_path,
        num_rounds=2,
        script_args="--hold site-2:0 --hold site-3:0",
        swarm_args={"min_clients": 2, "max_status_report_interval": 6, "progress_timeout": 90},
        controller_args={"min_responses_required": 2, "wait_time_after_min_resps_received": 30},
        starting_checkpoint="starting.safetensors" if checkpoint else "",
    )
    start = write_starting_checkpoint(job, 2, 32)
    running = in_background(simulate, job)

    go = [paused(tmp_path, site, 0, "holding") for site in ("site-2", "site-3")]
    site_1 = pids_of(str(tmp_path), "--site site-1")
    assert site_1
    for pid in site_1:
        os.kill(pid, signal.SIGKILL)
    for go_file in go:
        go_file.touch()
    result, output = running()

    if not checkpoint:
        assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
        reason = read_json(workspace / "summary.json")["reason"]
        assert "site-2 could not play round 1 again" in reason and "source_ckpt_file_full_name" in reason, reason
        return
    assert result.state is JobState.FINISHED_COMPLETED, output
    assert "site-2 sent round 1's model again, to another aggregation client" in output
    assert_site_1s_rounds_played_by_site_2_and_site_3(workspace, start)  # round 2: site-2's own turn


@pytest.mark.slow  # end to end; CI runs it with -m slow (the give-up: test_swarm_give_up.py)
@pytest.mark.parametrize(
    ("aggr_clients", "second"),
    [(None, "site-2"), (["site-2", "site-1", "site-3"], "site-3")],
    ids=["it aggregates round 1", "site-2 aggregates round 1"],
)
def test_a_starting_client_dying_as_round_1s_model_is_pulled_costs_the_round_which_another_plays_from_the_checkpoint(
    simulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aggr_clients: list[str] | None, second: str
) -> None:
    """site-1 starts the swarm from a starting checkpoint and dies while site-2 and site-3 pull round
    1's model from it (16 MiB in 16 KiB chunks: its 500th chunk served is one of those). When site-1
    aggregates round 1, its loss is fatal at once; when site-2 does, once site-2 and site-3 gave
    round 1 up (back at no round). Either way the server names site-2, which sends the checkpoint
    as round 1's model again, and the job completes with the checkpoint's weights moved by the
    rounds that counted."""
    monkeypatch.setenv(FAULT_POINT_ENV, "site-1/chunk_served@500")
    workspace = tmp_path / "workspace"
    swarm_args: dict[str, Any] = {"min_clients": 2, "max_status_report_interval": 6, "progress_timeout": 90}
    if aggr_clients is not None:
        swarm_args["aggr_clients"] = aggr_clients
    job = make_swarm_job(
        tmp_path,
        num_rounds=2,
        swarm_args=swarm_args,
        controller_args={"min_responses_required": 2, "wait_time_after_min_resps_received": 30},
        starting_checkpoint="starting.safetensors",
        **BIG,
    )
    start = write_starting_checkpoint(job, 1, 2048)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    assert "site-2 sent round 1's model again, to another aggregation client" in output
    for site in ("site-2", "site-3"):
        log_text = (workspace / site / "log.txt").read_text()
        assert "round 1's model not received" in log_text and "round 1's model comes again from site-2" in log_text
    assert_site_1s_rounds_played_by_site_2_and_site_3(workspace, start, second)


@pytest.mark.slow  # end to end; CI runs it with -m slow
def test_a_starting_client_dying_as_it_starts_the_swarm_is_replaced_by_the_first_aggregation_client_left(
    simulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """site-1, the starting client, dies (fault point ``swarm_round_sending``) as it is about to send
    round 1's model, before it answered its start task: the server follows the swarm without it,
    and site-2 sends round 1's model from the starting checkpoint instead."""
    monkeypatch.setenv(FAULT_POINT_ENV, "site-1/swarm_round_sending")
    workspace = tmp_path / "workspace"
    job = make_swarm_job(
        tmp_path,
        num_rounds=2,
        swarm_args={"min_clients": 2, "max_status_report_interval": 6, "progress_timeout": 90},
        controller_args={"min_responses_required": 2},
        starting_checkpoint="starting.safetensors",
    )
    start = write_starting_checkpoint(job, 2, 32)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    assert "site-1 died starting the workflow" in output
    assert "it started the swarm, and no other client has round 1's model: site-2 sent round 1's model again" in output
    assert_site_1s_rounds_played_by_site_2_and_site_3(workspace, start)


@pytest.mark.slow  # end to end; CI runs it with -m slow (the server's judgement: test_ccwf_server.py)
def test_an_aggregation_client_lost_with_the_next_rounds_model_costs_the_round_it_finished(
    simulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """site-2 aggregates round 2, reports it done, and dies about to send round 3's model (so no
    other client ever has it): site-1 sends round 2's model again, site-3 plays round 2 and round 3
    with site-1, and the job completes with the model of the rounds that counted."""
    monkeypatch.setenv(FAULT_POINT_ENV, "site-2/swarm_round_sending")
    job = make_swarm_job(
        tmp_path,
        num_rounds=3,
        swarm_args={"min_clients": 2, "max_status_report_interval": 6, "progress_timeout": 90},
        controller_args={"min_responses_required": 2, "wait_time_after_min_resps_received": 30},
    )
    initial = initial_model(job, 2, 32)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert [(entry["round"], entry["aggregator"], entry["clients"]) for entry in rounds] == [
        (1, "site-1", SITES),
        (2, "site-3", ["site-1", "site-3"]),  # played again: it replaces site-2's record
        (3, "site-3", ["site-1", "site-3"]),
    ]
    assert rounds[1]["played_again"] is True
    assert "and was the only client with its next round: site-1 sent round 2's model again" in output
    assert_rounds_that_counted(tmp_path / "workspace", ("site-1", "site-3"), initial, rounds, 3)


@pytest.mark.slow  # end to end; CI runs it with -m slow (the give-up: test_ccwf_peers.py, test_swarm_roles.py)
def test_an_aggregation_client_dying_as_its_next_rounds_model_is_pulled_costs_the_round_it_finished(
    simulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """site-2 aggregates round 2 and dies while site-1 and site-3 pull round 3's model from it
    (16 MiB in 16 KiB chunks: its 1500th chunk served is one of those): told by the server that
    site-2 is lost, both give round 3 up and report round 2 again, which site-1 sends again; site-3
    plays rounds 2 and 3 with site-1, and the job completes with the model of the rounds that counted."""
    monkeypatch.setenv(FAULT_POINT_ENV, "site-2/chunk_served@1500")
    job = make_swarm_job(
        tmp_path,
        num_rounds=3,
        swarm_args={"min_clients": 2, "max_status_report_interval": 6, "progress_timeout": 90},
        controller_args={"min_responses_required": 2, "wait_time_after_min_resps_received": 30},
        **BIG,
    )
    initial = initial_model(job, 1, 2048)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    for site in ("site-1", "site-3"):
        log_text = (tmp_path / "workspace" / site / "log.txt").read_text()
        assert "round 3's model not received: the server lost its sender site-2" in log_text
    assert "and was the only client with its next round: site-1 sent round 2's model again" in output
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert [(entry["round"], entry["aggregator"], entry["clients"]) for entry in rounds] == [
        (1, "site-1", SITES),
        (2, "site-3", ["site-1", "site-3"]),
        (3, "site-3", ["site-1", "site-3"]),
    ]
    assert_rounds_that_counted(tmp_path / "workspace", ("site-1", "site-3"), initial, rounds, 3)


def paused(root: Path, site: str, task: int, marker: str = "paused", timeout_s: float = 60.0) -> Path:
    """Wait until ``site``'s script waits before its task ``task`` (the bench script's ``--pause``),
    or holds it (``--hold``, ``marker`` "holding"); its go file."""
    deadline = time.monotonic() + timeout_s
    while not (found := list(root.rglob(f".{marker}-{site}-{task}"))):
        assert time.monotonic() < deadline, f"{site} never reached its {marker} at task {task}"
        time.sleep(0.05)
    return found[0].with_name(f".go-{site}-{task}")


def wait_for_line(path: Path, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.05)


def site_2_dies_with_round_3s_model(
    simulate, tmp_path: Path, late: str, holding: tuple[str, str]
) -> tuple[dict[str, torch.Tensor], Any, str]:
    """A 4-site, 4-round Swarm job where site-2 aggregates round 2 and sends round 3's model: the
    ``holding`` sites pull it whole and are held, site-2 dies (SIGKILL), and only then does ``late``,
    held at round 2 so far (round 2 closes without it once the others answered and 8 s passed),
    pull it, in vain. Returns the initial model, the job's result and its output."""
    workspace = tmp_path / "workspace"
    job = make_swarm_job(
        tmp_path,
        num_rounds=4,
        num_clients=4,
        script_args=f"--pause {late}:1 " + " ".join(f"--hold {site}:2" for site in holding),
        swarm_args={"min_clients": 2, "max_status_report_interval": 6, "progress_timeout": 90},
        controller_args={"min_responses_required": 2, "wait_time_after_min_resps_received": 8},
    )
    initial = initial_model(job, 2, 32)
    running = in_background(simulate, job)

    # Round 3's model goes to its aggregation client first, then to the others one after the other:
    # once both ``holding`` sites hold it, ``late`` took it too (queued: its learner waits on round 2).
    go = [paused(tmp_path, site, 2, "holding") for site in holding]
    site_2 = pids_of(str(tmp_path), "--site site-2")
    assert site_2
    for pid in site_2:
        os.kill(pid, signal.SIGKILL)
    late_log = workspace / late / "log.txt"
    wait_for_line(late_log, "the server lost site-2")
    paused(tmp_path, late, 1).touch()  # its round 2 goes on; then it pulls round 3's model, in vain
    wait_for_line(late_log, "round 3's model not received: the server lost its sender site-2")
    for go_file in go:
        go_file.touch()
    result, output = running()
    return initial, result, output


@pytest.mark.slow  # end to end; CI runs it with -m slow
def test_a_trainer_that_could_not_pull_a_dead_senders_model_misses_one_round_while_the_others_go_on(
    simulate, tmp_path: Path
) -> None:
    """site-2 aggregates round 2 and sends round 3's model; site-3 (round 3's aggregation client) and
    site-4 pull it whole, and site-2 dies (SIGKILL) before site-1, still busy with round 2, pulled
    it. Told by the server that site-2 is lost, site-1 gives round 3 up; site-3 aggregates round 3
    with site-4 and sends round 4's model on, which site-1 takes from it: site-1 misses one round,
    and the job completes with the exact model of the rounds that counted."""
    workspace = tmp_path / "workspace"
    initial, result, output = site_2_dies_with_round_3s_model(simulate, tmp_path, "site-1", ("site-3", "site-4"))

    assert result.state is JobState.FINISHED_COMPLETED, output
    rounds = read_json(workspace / "summary.json")["rounds"]
    assert [(entry["round"], entry["aggregator"]) for entry in rounds] == [
        (1, "site-1"),
        (2, "site-2"),
        (3, "site-3"),
        (4, "site-4"),
    ]
    assert rounds[2]["clients"] == ["site-3", "site-4"]  # site-1 gave round 3 up
    assert rounds[3]["clients"] == ["site-1", "site-3", "site-4"]  # and trained round 4
    assert_rounds_that_counted(workspace, ("site-1", "site-3", "site-4"), initial, rounds, 4)


@pytest.mark.slow  # end to end; CI runs it with -m slow
def test_a_round_its_aggregation_client_could_not_pull_is_dropped_by_its_trainers_and_the_round_before_played_again(
    simulate, tmp_path: Path
) -> None:
    """site-2 aggregates round 2 and sends round 3's model; site-1 and site-4 pull it whole and are
    held, and site-2 dies (SIGKILL) before site-3, round 3's aggregation client, still busy with
    round 2, pulled it. site-3 gives its round up; site-1 and site-4 hand it their results, which it
    refuses, and drop the round at its word; every client is back at round 2, which site-1 (round
    1's aggregation client) plays again: the job completes with the exact model of the rounds that
    counted, instead of ending at site-3's first refused result."""
    workspace = tmp_path / "workspace"
    initial, result, output = site_2_dies_with_round_3s_model(simulate, tmp_path, "site-3", ("site-1", "site-4"))

    assert result.state is JobState.FINISHED_COMPLETED, output
    for site in ("site-1", "site-4"):
        log_text = (workspace / site / "log.txt").read_text()
        assert "round 3 dropped: its aggregation client site-3 never got its model whole" in log_text
    assert "site-1 sent round 2's model again" in output
    rounds = read_json(workspace / "summary.json")["rounds"]
    assert [entry["round"] for entry in rounds] == [1, 2, 3, 4]
    assert rounds[0]["clients"] == ["site-1", "site-2", "site-3", "site-4"]
    assert rounds[1]["aggregator"] == "site-3" and rounds[1]["played_again"] is True
    assert all(entry["clients"] == ["site-1", "site-3", "site-4"] for entry in rounds[1:])  # round 2 again
    assert_rounds_that_counted(workspace, ("site-1", "site-3", "site-4"), initial, rounds, 4)


@pytest.mark.slow  # end to end; CI runs it with -m slow
def test_a_last_aggregation_client_lost_once_every_result_client_saved_the_final_model_ends_the_swarm_done(
    simulate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """site-2 aggregates the last round, sends the final model to site-1 and site-3 (both save it),
    and dies before it reports the swarm done: the swarm is done, with nothing played again."""
    monkeypatch.setenv(FAULT_POINT_ENV, "site-2/swarm_final_sent")
    job = make_swarm_job(
        tmp_path,
        num_rounds=2,
        swarm_args={"min_clients": 2, "max_status_report_interval": 6, "progress_timeout": 90},
        controller_args={"wait_time_after_min_resps_received": 30},
    )
    initial = initial_model(job, 2, 32)

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    assert "swarm done: the final model is with every result client left (site-1, site-3)" in output
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert [(entry["aggregator"], entry["clients"]) for entry in rounds] == [("site-1", SITES), ("site-2", SITES)]
    for site in ("site-1", "site-3"):
        assert_moved_by(final_model(tmp_path / "workspace", site), initial, 2 * expected_delta(3))


@pytest.mark.slow  # end to end; CI runs it with -m slow
def test_a_lost_trainer_is_not_waited_for_once_the_server_tells_the_swarm(simulate, tmp_path: Path) -> None:
    """site-3 dies training round 2. The rounds need 2 results and wait 60 s for a third; once the
    server judges site-3 lost it tells the others: round 2 closes with two, round 3 (site-3's turn
    to aggregate) goes to site-1 and waits for nobody, and the final model goes to site-1 and site-2."""
    job = make_swarm_job(
        tmp_path,
        num_rounds=3,
        script_args="--fault kill --fault-site site-3 --fault-round 1",
        swarm_args={"min_clients": 2, "max_status_report_interval": 6, "progress_timeout": 90},
        controller_args={"min_responses_required": 2, "wait_time_after_min_resps_received": 60},
    )
    initial = initial_model(job, 2, 32)
    started = time.monotonic()

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_COMPLETED, output
    assert time.monotonic() - started < 45, output  # not two rounds of 60 s
    rounds = read_json(tmp_path / "workspace" / "summary.json")["rounds"]
    assert [(entry["aggregator"], entry["clients"]) for entry in rounds] == [
        ("site-1", SITES),
        ("site-2", ["site-1", "site-2"]),
        ("site-1", ["site-1", "site-2"]),
    ]
    assert_rounds_that_counted(tmp_path / "workspace", ("site-1", "site-2"), initial, rounds, 3)


@pytest.mark.slow  # end to end and long; CI runs it with -m slow
def test_progress_timeout_ends_a_stalled_swarm(simulate, tmp_path: Path) -> None:
    job = make_swarm_job(  # site-2 never finishes training round 0, and the round needs all three
        tmp_path,
        num_rounds=2,
        script_args="--fault sleep --fault-site site-2 --fault-round 0 --sleep-s 8",
        swarm_args={"progress_timeout": 3},
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    reason = read_json(tmp_path / "workspace" / "summary.json")["reason"]
    assert "(progress_timeout=3 s)" in reason and "site-2: round 1 training" in reason, reason


def test_jobs_swarm_trains_the_digits_model_and_prints_the_matrix(simulate, tmp_path: Path) -> None:
    result, output = simulate(REPO / "jobs" / "swarm")

    assert result.state is JobState.FINISHED_COMPLETED, output
    workspace = tmp_path / "workspace"
    summary = read_json(workspace / "summary.json")
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    assert [r["aggregator"] for r in summary["rounds"]] == SITES  # aggregation moves from client to client
    assert "[round 3/3] done" in output and "cross-site evaluation (accuracy;" in output
    finals = [final_model(workspace, site) for site in SITES]
    assert all(torch.equal(finals[0][name], other[name]) for other in finals[1:] for name in finals[0])
    matrix = read_json(workspace / "server" / "cross_site_val.json")
    assert sorted(matrix) == SITES
    assert all(sorted(row) == ["global (site-1)", *SITES] for row in matrix.values())
    assert all(row["global (site-1)"]["accuracy"] >= 0.85 for row in matrix.values()), matrix
    assert not (workspace / "server" / "models").exists()  # the server never held a model
