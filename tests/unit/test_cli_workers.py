"""``flengine run``'s options for virtual clients: clear usage errors before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--backend", "ray"], "--backend ray runs virtual clients on workers: give -t W"),
        (["--worker-cpus", "2"], "--worker-cpus: only with --backend ray"),
        (["-t", "2", "--ray-address", "ray://host:10001"], "--ray-address: only with --backend ray"),
        (["-n", "4", "-t", "0"], "-t: expected at least 1 worker"),
    ],
)
def test_worker_options_that_do_not_fit_are_usage_errors(
    arguments: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", str(REPO / "jobs" / "fedavg"), "--workspace", str(tmp_path / "ws"), *arguments])

    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ws").exists()  # nothing started, nothing written


def test_resume_takes_the_workers_from_its_workspace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--resume", str(tmp_path), "-t", "2"]) == 2
    assert "--resume takes the run's own settings from its workspace; drop -t" in capsys.readouterr().err


def test_swarm_on_virtual_clients_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", str(REPO / "jobs" / "swarm"), "-n", "3", "-t", "2", "--workspace", str(tmp_path / "ws")])

    assert code == 2
    assert "has its clients work together at the same time" in capsys.readouterr().err
