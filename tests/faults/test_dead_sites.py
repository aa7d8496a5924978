"""Sites whose process dies during a job (real processes, the simulator): the job goes on with the
live ones while it can, replaces a dead site mid-round, ends naming the dead when too few are
left, and takes a site whose process was started again back into the rounds."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import job_code_on_path
from engine.runtime.states import JobState
from tests.faults.conftest import events_of, first_after, wait_for_event
from tests.integration.runtime.conftest import read_json
from tests.integration.runtime.jobkit import expected_delta, in_background, make_bench_job, pids_of

SITES = ["site-1", "site-2", "site-3"]


def _seed_sampling(site: str, round_index: int) -> int:
    """A sample_seed whose draw of 2 of the 3 sites takes ``site`` in round ``round_index`` (0-based)."""
    for seed in range(1000):
        rng = random.Random(seed)
        draws = [sorted(rng.sample(SITES, 2)) for _ in range(round_index + 1)]
        if site in draws[round_index] and all(site not in d for d in draws[:round_index]):
            return seed
    raise AssertionError("no such seed")


def _initial(job: Path, width: int) -> dict[str, torch.Tensor]:
    with job_code_on_path(job / "app" / "custom"):
        from benchnet_model import BenchNet

        return {name: t.detach().clone() for name, t in BenchNet(layers=2, width=width).state_dict().items()}


def test_a_site_killed_mid_job_leaves_the_sample_and_the_job_completes_exactly(
    simulate, tmp_path: Path, fault_figures
) -> None:
    rounds, width = 6, 16
    job = make_bench_job(
        tmp_path,
        num_rounds=rounds,
        width=width,
        script_args="--fault kill --fault-site site-3 --fault-round 1",
        workflow_args={"sample_seed": _seed_sampling("site-3", 1)},
    )
    initial = _initial(job, width)

    result, output = simulate(job, 3)

    assert result.state is JobState.FINISHED_COMPLETED, output
    summary = read_json(tmp_path / "workspace" / "summary.json")
    done = summary["rounds"]
    assert len(done) == rounds
    killed_in = done[1]
    assert killed_in["replacements"] and "site-3" in killed_in["sampled"]
    assert killed_in["dead"]["site-3"] == "its process exited with code -9"
    assert killed_in["failed"]["site-3"].startswith("CLIENT_DEAD")
    assert all("site-3" not in r["sampled"] for r in done[2:])  # dead sites are not sampled
    assert all(len(r["clients"]) == 2 for r in done)
    (death,) = summary["site_events"]
    assert death["event"] == "client_dead" and death["site"] == "site-3"
    assert "site-3: dead (its process exited with code -9)" in output
    assert "site-3 died during the round; asking" in output
    # The model is exactly the one of the results that counted, round by round.
    delta = sum(expected_delta(3, [int(site[-1]) for site in r["clients"]]) for r in done)
    final = load_file(tmp_path / "workspace" / "server" / "models" / "global.safetensors")
    for name, tensor in initial.items():
        assert torch.allclose(final[name].double(), tensor.double() + delta, rtol=0, atol=1e-6), name
    events = events_of(tmp_path / "workspace" / "server" / "events.jsonl")
    recovered = first_after(events, "round_done", death["at"])
    fault_figures.record(
        "simulator: a sampled site SIGKILLed mid-round (3 sites, 2 per round)",
        "dead at once (the launcher tells the server); a live site replaces it in the round; never sampled again; "
        "FINISHED_COMPLETED",
        recover_s=recovered["at"] - death["at"],
        rounds_lost=0,
        exact=True,
    )


def test_too_few_live_sites_end_the_job_naming_the_dead_one(simulate, tmp_path: Path, fault_figures) -> None:
    job = make_bench_job(
        tmp_path,
        num_rounds=3,
        script_args="--fault kill --fault-site site-2 --fault-round 1",
        workflow_args={"site_wait_timeout": 1.0},
    )

    result, output = simulate(job)

    assert result.state is JobState.FINISHED_EXECUTION_EXCEPTION, output
    summary = read_json(tmp_path / "workspace" / "summary.json")
    assert "1 of 2 sites alive, 2 needed (min_clients)" in summary["reason"]
    assert "dead: site-2 (its process exited with code -9)" in summary["reason"]
    assert "none came back within 1 s (site_wait_timeout)" in summary["reason"]
    assert [r["round"] for r in summary["rounds"]] == [1]
    fault_figures.record(
        "simulator: a site SIGKILLed when no other can replace it (2 sites, min_clients 2)",
        "the round waits site_wait_timeout (1 s here) for it, then FINISHED_EXECUTION_EXCEPTION naming the dead "
        "site and why",
    )


@pytest.mark.slow
def test_a_site_started_again_rejoins_the_rounds(simulate, tmp_path: Path, fault_figures) -> None:
    workspace = tmp_path / "workspace"
    job = make_bench_job(
        tmp_path,
        num_rounds=150,
        num_clients=3,
        min_clients=2,
        width=8,
        script_args="--fault kill --fault-site site-3 --fault-round 2",
    )
    running = in_background(simulate, job, 3)
    events = workspace / "server" / "events.jsonl"
    death = wait_for_event(events, "client_dead")
    assert death["site"] == "site-3"
    endpoint = wait_for_event(events, "listening")["endpoint"]

    restarted = subprocess.Popen(  # what a client daemon does: the site's job process, started again
        [
            sys.executable,
            "-m",
            "engine.runtime.entry",
            "client",
            "--site",
            "site-3",
            "--job",
            str(job),
            "--workspace",
            str(workspace),
            "--job-id",
            workspace.name,
            "--keys",
            str(workspace / "keys" / "site-3"),
            "--connect",
            endpoint,
        ],  # fmt: skip
        cwd=workspace / "site-3",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        result, output = running()
        assert restarted.wait(60) == 0
    finally:
        restarted.kill()

    assert result.state is JobState.FINISHED_COMPLETED, output
    summary = read_json(workspace / "summary.json")
    assert [e["event"] for e in summary["site_events"]] == ["client_dead", "client_back"]
    died, back = (e["at"] for e in summary["site_events"])
    rounds = summary["rounds"]
    assert "site-3" in rounds[2]["failed"]  # killed in round 3 (dead, or cut off when the round had enough)
    started = [e for e in events_of(events) if e["event"] == "round_started"]
    assert all("site-3" not in e["clients"] for e in started if died < e["at"] < back)  # not while dead
    assert all(e["clients"] == SITES for e in started if e["at"] > back)  # every round since
    assert any("site-3" in r["clients"] for r in rounds[3:])  # and its results count again
    counted = first_after(events_of(events), "round_done", back, lambda e: "site-3" in e["clients"])
    fault_figures.record(
        "simulator: a site SIGKILLed, then its job process started again",
        "the job goes on with the others; the site is back at its first task request and counts again",
        recover_s=counted["at"] - back,
        rounds_lost=0,
    )
    assert "site-3: back; it takes part again from the next round" in output


@pytest.mark.slow
def test_a_site_stopped_beyond_the_heartbeat_timeout_is_dead_then_back_after_sigcont(
    simulate, tmp_path: Path, fault_figures
) -> None:
    workspace = tmp_path / "workspace"
    job = make_bench_job(tmp_path, num_rounds=150, num_clients=3, min_clients=2, width=8)  # heartbeat timeout 3 s
    running = in_background(simulate, job, 3)
    events = workspace / "server" / "events.jsonl"
    wait_for_event(events, "round_done")
    (pid,) = pids_of(str(tmp_path), "--site site-3")

    stopped_at = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        death = wait_for_event(events, "client_dead", timeout_s=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    result, output = running()

    assert death["site"] == "site-3" and death["reason"] == "no heartbeat for 3 s"
    assert result.state is JobState.FINISHED_COMPLETED, output
    summary = read_json(workspace / "summary.json")
    assert [e["event"] for e in summary["site_events"]] == ["client_dead", "client_back"]
    back = summary["site_events"][1]["at"]
    started = [e for e in events_of(events) if e["event"] == "round_started"]
    assert all(e["clients"] == SITES for e in started if e["at"] > back)
    assert summary["processes"]["site-3"]["exit_code"] == 0
    first_back = first_after(events_of(events), "round_done", back, lambda e: "site-3" in e["clients"])
    fault_figures.record(
        "simulator: a site SIGSTOPped beyond the heartbeat timeout (3 s here), then SIGCONT",
        f"dead after {death['at'] - stopped_at:.1f} s (no heartbeat); the rounds go on without it; back at its "
        "first task request after SIGCONT",
        recover_s=first_back["at"] - back,
        rounds_lost=0,
    )
