"""tools/soak.py's pure parts: the least-squares slope, the per-process summary, the job copy and
the naming of a run's processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

from soak import Sample, fit_line, markdown_table, prepare_job, process_name, summarize  # noqa: E402

PY = "/venv/bin/python"


@pytest.mark.parametrize(
    ("xs", "ys", "slope", "stderr"),
    [
        ([1, 2, 3, 4], [10, 12, 14, 16], 2.0, 0.0),
        ([1, 2, 3, 4], [5, 5, 5, 5], 0.0, 0.0),
        ([0, 10], [3, 1], -0.2, 0.0),
        ([1, 2, 3, 4], [0, 1, 0, 1], 0.2, (0.8 / 2 / 5) ** 0.5),
    ],
    ids=["line", "flat", "two-points", "noisy"],
)
def test_the_fit_is_the_least_squares_slope_with_its_standard_error(
    xs: list[float], ys: list[float], slope: float, stderr: float
) -> None:
    fitted = fit_line(xs, ys)

    assert fitted == pytest.approx((slope, stderr))


@pytest.mark.parametrize(
    ("xs", "ys"), [([], []), ([3], [1.0]), ([2, 2, 2], [1.0, 2.0, 3.0])], ids=["none", "one", "same-x"]
)
def test_no_slope_without_two_distinct_rounds(xs: list[float], ys: list[float]) -> None:
    assert fit_line(xs, ys) is None


def test_a_summary_takes_round_10_the_last_round_and_the_slope_over_the_last_150_rounds() -> None:
    # RSS flat for the first 50 rounds (start-up noise around it), then +0.02 MiB a round; fds step once
    samples = [
        Sample(r, 100.0 + (5.0 if r < 5 else 0.0) + max(0, r - 50) * 0.02, 10 if r < 120 else 11, 7)
        for r in range(1, 201)
    ]

    summary = summarize(samples)

    assert summary["samples"] == 200
    assert summary["early"] == {"round": 10, "rss_mib": 100.0, "fds": 10, "threads": 7}
    assert summary["last"] == {"round": 200, "rss_mib": pytest.approx(103.0), "fds": 11, "threads": 7}
    assert summary["window_rounds"] == [51, 200]
    slopes = summary["slope_per_100_rounds"]
    assert slopes["rss_mib"] == pytest.approx(2.0)
    assert slopes["rss_mib_stderr"] == pytest.approx(0.0, abs=1e-4)
    assert slopes["fds"] == pytest.approx(fit_line(list(range(51, 201)), [10] * 69 + [11] * 81)[0] * 100, abs=1e-4)
    assert slopes["threads"] == 0.0


def test_a_short_run_is_summarized_over_what_exists_and_missed_rounds_are_skipped() -> None:
    samples = [Sample(r, 50.0 + r, 4, 3) for r in (1, 2, 4, 7)]  # rounds 3, 5, 6 ended within one poll

    summary = summarize(samples)

    assert summary["early"]["round"] == 7  # no round 10: the last one
    assert summary["window_rounds"] == [1, 7]
    assert summary["slope_per_100_rounds"]["rss_mib"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="no samples"):
        summarize([])


def test_a_slope_above_the_goal_is_marked_in_the_table() -> None:
    samples = [Sample(r, 100.0 + r * 0.05, 9, 5) for r in range(1, 21)]
    run = {"mode": "sim", "processes": [{"name": "server", **summarize(samples), "within_goal": False}]}

    (header, _, row) = markdown_table([run])

    assert header.startswith("| mode | process | round 10: RSS MiB / fds / threads |")
    assert row == (
        "| sim | server | 100.5 / 9 / 5 (round 10) | 101.0 / 9 / 5 (round 20) "
        "| +5.000 ± 0.000 (above goal) / +0.00 / +0.00 (rounds 1-20) |"
    )


@pytest.mark.parametrize(
    ("cmdline", "name"),
    [
        ([PY, "-m", "engine", "run", "/t/job", "-n", "2"], "simulator"),
        ([PY, "-m", "engine.runtime.launcher_process", "--job", "/t/job", "--room", ""], "launcher"),
        ([PY, "-m", "engine.runtime.entry", "server", "--site", "server", "--job", "/t/job"], "server"),
        ([PY, "-m", "engine.runtime.entry", "client", "--job", "/t/j", "--site", "site-2"], "site-2"),
        ([PY, "-m", "engine", "server", "start", "/t/poc/kits/server", "--workspace", "/t/w"], "server daemon"),
        ([PY, "-m", "engine", "client", "start", "/t/poc/kits/site-1"], "site-1 daemon"),
        ([PY, "-m", "engine", "admin", "/t/poc/kits/admin", "submit", "/t/job"], None),
        ([PY, "-m", "engine", "poc", "stop", "-d", "/t/poc"], None),
        ([PY, "/t/job/app/custom/train.py", "--epochs", "2"], "script train.py"),
    ],
    ids=["simulator", "launcher", "server", "site", "server-daemon", "site-daemon", "admin", "poc", "script"],
)
def test_each_process_of_a_run_is_named_by_its_command_line(cmdline: list[str], name: str | None) -> None:
    assert process_name(cmdline) == name


def test_the_job_copy_runs_the_rounds_and_clients_asked_for_and_leaves_the_source_alone(tmp_path: Path) -> None:
    source = Path(__file__).resolve().parents[2] / "jobs" / "fedavg"
    before = (source / "app" / "config" / "config_fed_server.conf").read_text()

    job = prepare_job(source, tmp_path / "copy", rounds=201, clients=3)

    server = (job / "app" / "config" / "config_fed_server.conf").read_text()
    assert "num_rounds = 201" in server and "num_clients = 3" in server
    assert "min_clients = 3" in (job / "meta.conf").read_text()
    assert (source / "app" / "config" / "config_fed_server.conf").read_text() == before


def test_a_job_without_num_rounds_is_refused_by_name(tmp_path: Path) -> None:
    source = tmp_path / "odd"
    (source / "app" / "config").mkdir(parents=True)
    (source / "app" / "config" / "config_fed_server.conf").write_text("workflows = []\n")

    with pytest.raises(RuntimeError, match=r"odd: no `num_rounds = N` in a config_fed_server file"):
        prepare_job(source, tmp_path / "copy", rounds=5, clients=2)
