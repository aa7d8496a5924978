"""`flengine admin watch` and `admin logs --follow` with real daemons, read as an operator reads them:
the rounds of a running job appear while it runs (a site held before its second round proves it),
the command returns when the job ends, 0 for a completed job and 1 with the state and reason
otherwise, and a member of another org learns nothing more than of an unknown job."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.deploy.test_production import SITES, Deployment, deployment  # noqa: F401
from tests.integration.runtime.jobkit import make_bench_job


@pytest.fixture
def running(deployment: Deployment) -> Deployment:  # noqa: F811
    deployment.start("server", "server")
    for site in SITES:
        deployment.start(site, "client")
    deployment.wait_connected(*SITES)
    return deployment


class Watcher:
    """A ``flengine admin`` command that streams (watch, logs --follow): its stdout lines as they come."""

    def __init__(self, deployment: Deployment, *args: str) -> None:  # noqa: F811
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine", "admin", str(deployment.kits / "alice"), *args],
            cwd=deployment.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, text: str, timeout_s: float = 90.0) -> str:
        """Read lines until one holds ``text``; that line."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} within {timeout_s:g} s: {self.seen}")

    def finish(self, timeout_s: float = 120.0) -> tuple[int, list[str], str]:
        """Wait for the end: exit code, the stdout lines not read yet, stderr."""
        code = self.process.wait(timeout_s)
        rest = []
        while (line := self.lines.get(timeout=10)) is not None:
            rest.append(line)
        assert self.process.stderr is not None
        return code, rest, self.process.stderr.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def watchers() -> Iterator[list[Watcher]]:
    started: list[Watcher] = []
    yield started
    for watcher in started:
        watcher.close()


def let_go(root: Path, site: str) -> None:
    """Let a site paused by ``--fault pause`` go on (its script waits for ``.go-SITE`` beside it)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        paused = list(root.rglob(f".paused-{site}"))
        if paused:
            for marker in paused:
                (marker.parent / f".go-{site}").touch()
            return
        time.sleep(0.1)
    raise AssertionError(f"{site} never paused")


@pytest.mark.slow  # tests/unit/deploy/test_watch.py watches a real daemon in the default set
def test_watch_shows_the_rounds_of_a_running_job_as_they_happen_and_exits_0_when_it_completed(
    running: Deployment, watchers: list[Watcher], tmp_path: Path
) -> None:
    # site-2 holds before it receives its task of the second round: round 1 is done, the job runs on
    job = make_bench_job(
        tmp_path / "jobs", num_rounds=3, script_args="--fault pause --fault-site site-2 --fault-round 1"
    )
    job_id = running.admin("alice", "submit", str(job)).stdout.split()[1]
    watch = Watcher(running, "watch", job_id)
    follow = Watcher(running, "logs", job_id, "--follow", "--format", "json")
    watchers += [watch, follow]

    first = watch.until(f"job {job_id}")
    done = watch.until("[round 1/3] done in")
    status_then = running.admin_json("alice", "status", job_id)["status"]
    let_go(running.root, "site-2")
    code, rest, stderr = watch.finish()

    assert first.startswith(f"job {job_id} (bench) of alice: ")
    assert "2 results" in done
    assert status_then == "RUNNING"  # shown while the job ran, not replayed after its end
    assert (code, stderr) == (0, "")
    assert any(line.startswith("[round 3/3] done in") for line in rest)
    table = rest[rest.index("site    state    daemon         last result") + 1 :][:2]
    assert [line.split(" (")[0] for line in table] == [f"{site}  idle     connected      round 3: ok" for site in SITES]
    assert rest[-1] == f"job {job_id}: FINISHED_COMPLETED"
    followed_code, followed, _ = follow.finish()
    updates = [json.loads(line) for line in follow.seen + followed]
    assert followed_code == 0
    assert updates[-1]["ended"] is True and updates[-1]["status"] == "FINISHED_COMPLETED"
    assert any("job done" in line or "round" in line for update in updates for line in update["lines"])


@pytest.mark.slow
def test_watch_of_a_failed_job_exits_1_with_its_state_and_reason_and_another_org_sees_no_job(
    running: Deployment, watchers: list[Watcher], tmp_path: Path
) -> None:
    job = make_bench_job(tmp_path / "jobs", num_rounds=2, script_args="--fault raise --fault-site site-2")
    job_id = running.admin("alice", "submit", str(job)).stdout.split()[1]
    watch = Watcher(running, "watch", job_id, "--format", "json")
    watchers.append(watch)

    code, rest, _ = watch.finish()
    carol = running.admin("carol", "watch", job_id)
    made_up = running.admin("carol", "watch", "0123456789ab")

    updates = [json.loads(line) for line in rest]
    assert code == 1
    assert all(not update["final"] for update in updates[:-1])
    assert updates[-1]["final"] is True and updates[-1]["status"] == "FINISHED_EXECUTION_EXCEPTION"
    assert "injected failure on site-2" in updates[-1]["reason"]
    assert (carol.returncode, carol.stdout, carol.stderr) == (1, "", f"Error: no job {job_id}\n")
    assert carol.stderr == made_up.stderr.replace("0123456789ab", job_id)
