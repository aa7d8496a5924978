"""Runtime pieces that need no process: routing and filters, progress lines, job states, simulator arguments."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest

from engine.cli import main
from engine.config import ConfigDocument
from engine.errors import ConfigError, FilterError, PathOutsideError, UsageError
from engine.executors.executor import Executor
from engine.filters.filter import Filter
from engine.model import Shareable
from engine.paths import JobPaths
from engine.runtime.assembly import (
    STREAMING_KEYS,
    ExecutorRoute,
    FilterChains,
    build_executors,
    prepare_components,
    route_task,
    streaming_settings,
)
from engine.runtime.progress import ProgressPrinter, summary_table
from engine.runtime.simulator import SimulationResult, run_simulation
from engine.runtime.states import JobState

REPO = Path(__file__).resolve().parents[3]
FEDAVG = REPO / "jobs" / "fedavg"
HERE = __name__  # dotted module path of the components below, for configs that build them


class Named(Executor):
    """An executor that only says which one it is."""

    def __init__(self, label: str) -> None:
        self.label = label

    def execute(self, task_name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        return shareable


class Tag(Filter):
    """Appends ``label`` to the ``trail`` header, so a test can read the order filters ran in."""

    def __init__(self, label: str) -> None:
        self.label = label

    def process(self, shareable: Shareable, site: str) -> Shareable:
        shareable.set_header("trail", [*shareable.get_header("trail", []), f"{self.label}@{site}"])
        return shareable


class Explode(Filter):
    def process(self, shareable: Shareable, site: str) -> Shareable:
        raise KeyError("weights")


class ReturnsDict(Filter):
    def process(self, shareable: Shareable, site: str) -> Shareable:
        return dict(shareable)  # type: ignore[return-value]


def _document(data: dict[str, Any]) -> ConfigDocument:
    return ConfigDocument(Path("config_fed_client.conf"), "app/config/config_fed_client.conf", data)


def _entry(cls: type, **args: Any) -> dict[str, Any]:
    return {"path": f"{HERE}.{cls.__name__}", "args": args}


# ----------------------------------------------------------------------------- executors


@pytest.mark.parametrize(
    ("patterns", "task_name", "expected"),
    [
        pytest.param(["*"], "train", True, id="star-matches-all"),
        pytest.param(["train"], "train", True, id="exact-name"),
        pytest.param(["train"], "training", False, id="name-is-not-a-prefix"),
        pytest.param(["train", "validate"], "validate", True, id="second-name"),
        pytest.param(["val*"], "validate", True, id="glob"),
        pytest.param(["Train"], "train", False, id="case-sensitive"),
        pytest.param([], "train", False, id="no-names"),
    ],
)
def test_route_matches_task_names(patterns: list[str], task_name: str, expected: bool) -> None:
    assert ExecutorRoute(patterns, executor=None).matches(task_name) is expected


@pytest.mark.parametrize(
    ("task_name", "expected"),
    [
        pytest.param("train", "trainer", id="first-match-wins"),
        pytest.param("validate", "fallback", id="falls-through-to-star"),
    ],
)
def test_route_task_takes_the_first_matching_route(task_name: str, expected: str) -> None:
    routes = [ExecutorRoute(["train"], "trainer"), ExecutorRoute(["*"], "fallback"), ExecutorRoute(["train"], "late")]

    assert route_task(routes, task_name) == expected


def test_route_task_without_a_match_is_none() -> None:
    assert route_task([ExecutorRoute(["train"], "trainer")], "validate") is None


def test_build_executors_keeps_config_order() -> None:
    document = _document(
        {
            "executors": [
                {"tasks": ["train"], "executor": _entry(Named, label="a")},
                {"tasks": ["*"], "executor": _entry(Named, label="b")},
            ]
        }
    )

    routes = build_executors(document)

    assert [(route.tasks, route.executor.label) for route in routes] == [(["train"], "a"), (["*"], "b")]
    assert route_task(routes, "validate").label == "b"


# ----------------------------------------------------------------------------- filters


@pytest.fixture
def chains() -> FilterChains:
    document = _document(
        {
            "task_result_filters": [
                {"tasks": ["train"], "filters": [_entry(Tag, label="first"), _entry(Tag, label="second")]},
                {"tasks": ["validate"], "filters": [_entry(Tag, label="val")]},
                {"tasks": ["*"], "filters": [_entry(Tag, label="all")]},
            ]
        }
    )
    return FilterChains.build(document, "task_result_filters")


@pytest.mark.parametrize(
    ("task_name", "trail"),
    [
        pytest.param("train", ["first@site-1", "second@site-1", "all@site-1"], id="train"),
        pytest.param("validate", ["val@site-1", "all@site-1"], id="validate"),
        pytest.param("other", ["all@site-1"], id="only-star"),
    ],
)
def test_filters_run_in_order_for_matching_chains(chains: FilterChains, task_name: str, trail: list[str]) -> None:
    result = chains.apply(task_name, Shareable(), "site-1")

    assert result.get_header("trail") == trail


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param({}, False, id="no-key"),
        pytest.param({"task_data_filters": [{"tasks": ["*"], "filters": []}]}, False, id="empty-chain"),
        pytest.param({"task_data_filters": [{"tasks": ["*"], "filters": [_entry(Tag, label="x")]}]}, True, id="one"),
    ],
)
def test_chains_are_true_only_with_a_filter(data: dict[str, Any], expected: bool) -> None:
    assert bool(FilterChains.build(_document(data), "task_data_filters")) is expected


def test_a_task_is_filtered_once_for_every_site_only_when_each_filter_says_so() -> None:
    from engine.filters import GaussianPrivacy, Quantize

    chains = FilterChains([(["train"], [Quantize("int8")]), (["validate"], [Quantize("bf16"), Tag("x")])])
    assert chains.same_for_every_site("train")  # the server then encodes it once for all its clients
    assert not chains.same_for_every_site("validate")  # Tag may depend on the site
    assert chains.same_for_every_site("submit_model")  # no filter applies
    assert not FilterChains([(["*"], [GaussianPrivacy(clip_norm=1.0, noise_multiplier=1.0)])]).same_for_every_site(
        "train"
    )  # noise drawn per site


def test_no_matching_chain_passes_the_shareable_through() -> None:
    shareable = Shareable(w=1)

    result = FilterChains([(["train"], [Tag("x")])]).apply("validate", shareable, "site-1")

    assert result is shareable
    assert result.get_header("trail") is None


@pytest.mark.parametrize(
    ("bad", "message", "cause"),
    [
        pytest.param(Explode(), r"^filter Explode failed on task 'train': 'weights'$", KeyError, id="raises"),
        pytest.param(
            ReturnsDict(), r"^filter ReturnsDict returned dict, not a Shareable$", type(None), id="not-a-shareable"
        ),
    ],
)
def test_a_failing_filter_is_named(bad: Filter, message: str, cause: type) -> None:
    chains = FilterChains([(["*"], [Tag("before"), bad, Tag("after")])])

    with pytest.raises(FilterError, match=message) as caught:
        chains.apply("train", Shareable(), "site-1")

    assert isinstance(caught.value.__cause__, cause)


class Reads:
    """A component that reads a file its config names (as a persistor's checkpoint to start from)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.calls: list[Any] = []

    def use_workspace(self, app_dir: Path) -> None:
        self.calls.append(("use_workspace", app_dir))

    def use_job_paths(self, paths: JobPaths) -> None:
        self.calls.append("use_job_paths")
        self.path = paths.resolve(self.source, "source")


def test_prepare_components_gives_each_component_its_workspace_and_job_paths(tmp_path: Path) -> None:
    document = ConfigDocument(tmp_path / "s.conf", "s.conf", {})
    reader = Reads("custom/start.safetensors")
    paths = JobPaths(tmp_path / "job" / "app", tmp_path / "job", tmp_path / "ws")

    prepare_components({"plain": object(), "reader": reader}, document, tmp_path / "ws", paths)

    assert reader.calls == [("use_workspace", tmp_path / "ws"), "use_job_paths"]
    assert reader.path == tmp_path / "job" / "app" / "custom" / "start.safetensors"


def test_a_component_path_outside_the_job_is_a_config_error_at_its_file_line_and_key(tmp_path: Path) -> None:
    key_lines = {("components", 1, "args", "source"): 9}
    document = ConfigDocument(tmp_path / "s.conf", "job/app/config/s.conf", {}, key_lines)
    paths = JobPaths(tmp_path / "job" / "app", tmp_path / "job", tmp_path / "ws")

    with pytest.raises(ConfigError) as caught:
        prepare_components({"plain": object(), "reader": Reads("/etc/passwd")}, document, tmp_path / "ws", paths)

    assert str(caught.value).startswith(
        "job/app/config/s.conf:9: components[1].args.source: '/etc/passwd' leads to /etc/passwd, outside the job folder"
    )
    assert isinstance(caught.value.__cause__, PathOutsideError)


def test_streaming_settings_pick_only_the_streaming_keys() -> None:
    config = {
        "format_version": 2,
        "executors": [],
        "tensor_download_chunk_size": 1024,
        "streaming_per_request_timeout": 30,
    }

    settings = streaming_settings(config)

    assert settings == {"tensor_download_chunk_size": 1024, "streaming_per_request_timeout": 30}


def test_streaming_settings_keep_every_streaming_key() -> None:
    config = {key: i for i, key in enumerate(STREAMING_KEYS)}

    assert streaming_settings(config) == config


# ----------------------------------------------------------------------------- progress


@pytest.fixture
def out() -> io.StringIO:
    return io.StringIO()


@pytest.fixture
def printer(out: io.StringIO) -> ProgressPrinter:
    return ProgressPrinter(out, ["site-1", "site-2"], detail=True)


@pytest.mark.parametrize(
    ("event", "line"),
    [
        pytest.param(
            {"event": "listening", "endpoint": "tcp://127.0.0.1:5555"},
            "server listening on tcp://127.0.0.1:5555; starting site-1, site-2",
            id="listening",
        ),
        pytest.param({"event": "workflow_started", "workflow": "FedAvg"}, "workflow FedAvg started", id="workflow"),
        pytest.param(
            {"event": "round_started", "round": 1, "total_rounds": 3, "clients": ["site-1", "site-2"]},
            "[round 1/3] sending the model to site-1, site-2",  # the server's rounds count from 1
            id="round_started",
        ),
        pytest.param(
            {"event": "round_started", "round": None, "total_rounds": 3},
            "[round ?/3] sending the model to the clients",
            id="round_started-unknown-round",
        ),
        pytest.param(
            {"event": "task_sent", "site": "site-1", "task": "train"},
            "[round ?/?] site-1: train started",
            id="task_sent",
        ),
        pytest.param(
            {"event": "result_received", "site": "site-2", "bytes": 3 * 2**20, "seconds": 1.5},
            "[round ?/?] site-2: result received (3.0 MiB in 1.50 s, 2 MiB/s)",
            id="result_received",
        ),
        pytest.param(
            {
                "event": "round_done",
                "time_s": 1.234,
                "clients": ["site-1", "site-2"],
                "metrics": {"acc": 0.91234, "n": 3},
            },
            "[round ?/?] done in 1.23 s, 2 results: acc=0.9123 n=3",
            id="round_done",
        ),
        pytest.param(
            {"event": "round_done", "time_s": 2, "clients": ["site-1"]},
            "[round ?/?] done in 2.00 s, 1 result",
            id="round_done-one-no-metrics",
        ),
        pytest.param(
            {"event": "client_dead", "site": "site-2", "reason": "no heartbeat for 10 s"},
            "[round ?/?] site-2: dead (no heartbeat for 10 s); left out of the rounds until it comes back",
            id="client_dead",
        ),
        pytest.param(
            {"event": "client_back", "site": "site-2"},
            "[round ?/?] site-2: back; it takes part again from the next round",
            id="client_back",
        ),
        pytest.param(
            {"event": "round_replacements", "lost": ["site-3"], "drawn": ["site-2"]},
            "[round ?/?] site-3 died during the round; asking site-2 instead",
            id="round_replacements",
        ),
        pytest.param(
            {"event": "workflow_resumed", "round": 4, "total_rounds": 10},
            "[round 4/10] resuming here: the rounds before it were played before the server stopped",
            id="workflow_resumed",
        ),
        pytest.param(
            {"event": "checkpoint_failed", "reason": "OSError: [Errno 28] No space left on device"},
            "[round ?/?] checkpoint not written (OSError: [Errno 28] No space left on device); the job goes on",
            id="checkpoint_failed",
        ),
        pytest.param(
            {"event": "round_retried", "lost": ["site-3"]},
            "[round ?/?] too few results after site-3 died; playing the round again",
            id="round_retried",
        ),
        pytest.param(
            {"event": "waiting_for_sites", "alive": ["site-1"], "needed": 2, "dead": {"site-2": "x"}, "timeout_s": 60},
            "[round ?/?] waiting up to 60 s for sites: 1 alive, 2 needed; dead: site-2",
            id="waiting_for_sites",
        ),
        pytest.param({"event": "workflow_note", "message": "early stop"}, "[round ?/?] early stop", id="workflow_note"),
        pytest.param(
            {"event": "job_done", "state": "FINISHED_COMPLETED"},
            "server finished: FINISHED_COMPLETED",
            id="job_done",
        ),
        pytest.param(
            {"event": "job_done", "state": "FINISHED_ABORTED", "reason": "aborted by the server"},
            "server finished: FINISHED_ABORTED (aborted by the server)",
            id="job_done-reason",
        ),
    ],
)
def test_each_event_prints_one_line(printer: ProgressPrinter, out: io.StringIO, event: dict, line: str) -> None:
    printer.show(event)

    assert out.getvalue() == line + "\n"


@pytest.mark.parametrize(
    "event",
    [
        {"event": "heartbeat"},
        {},
        {"event": "result_received", "site": "site-2", "bytes": 0, "seconds": 0.0},
        {"event": "result_received", "site": "site-2", "bytes": 2**20, "seconds": 1.0, "ok": False},
    ],
    ids=["unknown", "no-event", "control-task-result", "failed-result"],
)
def test_other_events_print_nothing(printer: ProgressPrinter, out: io.StringIO, event: dict) -> None:
    printer.show(event)

    assert out.getvalue() == ""


def test_lines_after_a_round_start_carry_its_number(printer: ProgressPrinter, out: io.StringIO) -> None:
    printer.show({"event": "round_started", "round": 2, "total_rounds": 5, "clients": ["site-1"]})

    printer.show({"event": "task_sent", "site": "site-1", "task": "train"})

    assert out.getvalue().splitlines()[-1] == "[round 2/5] site-1: train started"


def test_noted_is_true_from_the_second_time(printer: ProgressPrinter) -> None:
    assert [printer.noted("site-1"), printer.noted("site-1"), printer.noted("site-2")] == [False, True, False]


def test_summary_table_lists_rounds_and_processes() -> None:
    summary = {
        "rounds": [{"round": 1, "time_s": 1.5, "metrics": {"accuracy": 0.5, "n": 3}}, {"round": None}],
        "processes": {
            "server": {"peak_rss_mb": 120.5, "exit_code": 0},
            "site-1": {"peak_rss_mb": None, "exit_code": 1},
        },
        "status": "FINISHED_COMPLETED",
        "reason": "",
        "seconds": 12.34,
        "workspace": "/tmp/ws",
    }

    lines = summary_table(summary)

    assert lines == [
        "",
        "round  time (s)  metrics",
        "    1      1.50  accuracy=0.5000 n=3",
        "    ?      0.00  ",
        "",
        "process   peak RSS (MiB)  exit code",
        "server             120.5  0",
        "site-1                 -  1",
        "",
        "FINISHED_COMPLETED in 12.3 s",
        "workspace: /tmp/ws",
    ]


def test_summary_table_without_rounds_says_so_and_gives_the_reason() -> None:
    lines = summary_table({"status": "FINISHED_ABORTED", "reason": "interrupted (Ctrl-C)", "workspace": "ws"})

    assert "    -         -  (no round finished)" in lines
    assert lines[-2:] == ["FINISHED_ABORTED (interrupted (Ctrl-C)) in 0.0 s", "workspace: ws"]


# ----------------------------------------------------------------------------- states


@pytest.mark.parametrize(
    ("state", "final", "exit_code"),
    [
        pytest.param(JobState.SUBMITTED, False, 1, id="submitted"),
        pytest.param(JobState.RUNNING, False, 1, id="running"),
        pytest.param(JobState.FINISHED_COMPLETED, True, 0, id="completed"),
        pytest.param(JobState.FINISHED_ABORTED, True, 130, id="aborted"),
        pytest.param(JobState.FINISHED_EXECUTION_EXCEPTION, True, 1, id="execution_exception"),
    ],
)
def test_states_final_and_exit_codes(state: JobState, final: bool, exit_code: int, tmp_path: Path) -> None:
    assert state.is_final is final
    assert JobState(state.value) is state
    assert SimulationResult(state, tmp_path).exit_code == exit_code


# ----------------------------------------------------------------------------- simulator arguments


@pytest.mark.parametrize(
    ("n_clients", "message"),
    [
        pytest.param(0, r"^-n: expected at least 1 client, got 0$", id="zero"),
        pytest.param(-3, r"^-n: expected at least 1 client, got -3$", id="negative"),
        pytest.param(1, r"^-n 1: the job needs at least min_clients = 2 clients", id="below-min_clients"),
    ],
)
def test_bad_client_count_is_a_usage_error(n_clients: int, message: str, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"

    with pytest.raises(UsageError, match=message):
        run_simulation(FEDAVG, n_clients=n_clients, workspace=workspace)

    assert not workspace.exists()


@pytest.mark.parametrize("occupant", ["folder-with-a-file", "a-file"])
def test_workspace_must_be_new_or_empty(tmp_path: Path, occupant: str) -> None:
    if occupant == "a-file":
        workspace = tmp_path / "ws.txt"
        workspace.write_text("taken")
    else:
        workspace = tmp_path / "ws"
        workspace.mkdir()
        (workspace / "old.log").write_text("taken")

    with pytest.raises(UsageError, match=f"^--workspace {workspace}: not an empty folder"):
        run_simulation(FEDAVG, n_clients=2, workspace=workspace)


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    ("argv", "code", "error"),
    [
        pytest.param(["run", "nonexistent"], 1, "Error: nonexistent: no such job folder", id="missing-job"),
        pytest.param(["run", str(FEDAVG), "-n", "0"], 2, "Error: -n: expected at least 1 client, got 0", id="n-zero"),
    ],
)
def test_run_errors_print_one_error_line(
    argv: list[str],
    code: int,
    error: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)

    exit_code = main(argv)

    err = capsys.readouterr().err
    assert exit_code == code
    assert err.splitlines() == [error]
    assert "Traceback" not in err


def test_run_help_documents_clients_and_workspace(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["run", "--help"])

    out = capsys.readouterr().out
    assert caught.value.code == 0
    assert "-n N, --clients N" in out
    assert "--workspace DIR" in out
    assert "--allow-dir DIR" in out
    assert "a new or empty folder" in out


def test_summary_table_shows_the_cross_site_matrix_one_metric_per_cell() -> None:
    summary = {
        "status": "FINISHED_COMPLETED",
        "cross_site_val": {
            "site-1": {"global (site-1)": {"accuracy": 0.91234, "loss": 0.3}, "site-2": {"accuracy": 0.8}},
            "site-2": {"global (site-1)": {"accuracy": 0.9}, "site-2": {"error": "ERROR: no data"}},
        },
    }

    lines = summary_table(summary)

    start = lines.index("cross-site evaluation (accuracy; rows: evaluators, columns: models)")
    header, first, second = lines[start + 1 : start + 4]
    assert header.split() == ["global", "(site-1)", "site-2"]
    assert first.split() == ["site-1", "0.9123", "0.8000"]
    assert second.split() == ["site-2", "0.9000", "error"]


def test_swarm_rounds_show_their_own_number_and_workflow_lines_their_name(out: io.StringIO) -> None:
    printer = ProgressPrinter(out, ["site-1"], detail=True)

    printer.show({"event": "workflow_started", "workflow": "swarm"})
    printer.show({"event": "task_sent", "site": "site-1", "task": "swarm_config"})
    printer.show({"event": "round_started", "round": 2, "total_rounds": 3, "clients": []})
    printer.show({"event": "round_done", "round": 1, "time_s": 1.0, "clients": ["site-1"]})

    assert out.getvalue().splitlines() == [
        "workflow swarm started",
        "[swarm] site-1: swarm_config started",
        "[round 2/3] started",
        "[round 1/3] done in 1.00 s, 1 result",
    ]


def test_outside_a_terminal_a_round_is_one_line() -> None:
    out = io.StringIO()  # not a terminal: a pipe, a log file
    printer = ProgressPrinter(out, ["site-1", "site-2"])
    for event in (
        {"event": "workflow_started", "workflow": "fedavg"},
        {"event": "round_started", "round": 1, "total_rounds": 2, "clients": ["site-1", "site-2"]},
        {"event": "task_sent", "site": "site-1", "task": "train"},
        {"event": "result_received", "site": "site-1", "bytes": 2**20, "seconds": 0.5},
        {"event": "round_done", "round": 1, "time_s": 1.0, "clients": ["site-1"], "refused": {"site-2": "NaN"}},
        {"event": "round_started", "round": 2, "total_rounds": 2, "clients": ["site-1", "site-2"]},
        {"event": "client_dead", "site": "site-2"},
    ):
        printer.show(event)

    assert out.getvalue().splitlines() == [
        "workflow fedavg started",
        "[round 1/2] done in 1.00 s, 1 result; refused: site-2",
        "[round 2/2] site-2: dead (stopped answering); left out of the rounds until it comes back",
    ]
