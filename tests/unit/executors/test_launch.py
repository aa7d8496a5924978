"""The ``command`` a training script is launched with, and what its stderr says when it dies."""

from __future__ import annotations

import shutil
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from engine.executors.client_api import REASON_HEADER, ClientAPIExecutor
from engine.executors.executor import ExecutorContext
from engine.executors.launch import (
    StderrTail,
    parse_command,
    resolve_command,
    script_environment,
)
from engine.model import FLModel, ReturnCode, shareable_from_model

# ----------------------------------------------------------------------------- parse_command


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("", []),
        ("   ", []),
        ([], []),
        ("python -u", ["python", "-u"]),
        ("torchrun --standalone --nproc_per_node 2", ["torchrun", "--standalone", "--nproc_per_node", "2"]),
        (
            "torchrun --nproc_per_node=2 --rdzv_endpoint=localhost:29400",
            ["torchrun", "--nproc_per_node=2", "--rdzv_endpoint=localhost:29400"],
        ),
        ("'/opt/my tools/launch' -n 2", ["/opt/my tools/launch", "-n", "2"]),
        (["torchrun", "--nproc_per_node", "2"], ["torchrun", "--nproc_per_node", "2"]),
    ],
    ids=["empty", "blank", "empty-list", "python", "torchrun", "equals-and-colons", "quoted-path", "list"],
)
def test_a_command_is_split_into_its_argv(command: str | list[str], argv: list[str]) -> None:
    assert parse_command(command) == argv


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("torchrun train.py; rm -rf /", r"has shell syntax \(;\)"),
        ("torchrun | tee log", r"has shell syntax \(\|\)"),
        ("torchrun && echo done", r"has shell syntax \(&\)"),
        ("torchrun > out.txt", r"has shell syntax \(>\)"),
        ("torchrun --nproc_per_node $NGPUS", r"has shell syntax \(\$\)"),
        ("torchrun `nproc`", r"has shell syntax \(`\)"),
        ("torchrun $(nproc)", r"has shell syntax \(\$\(\)\)"),
        ("torchrun *.py", r"has shell syntax \(\*\)"),
        ("python ~/x", r"has shell syntax \(~\)"),
        (["torchrun", "a\nb"], r"has shell syntax \(\\x0a\)"),
        (["torchrun", "it's"], r"has shell syntax \('\)"),
        (["torchrun", ""], r"an empty argument"),
        ("torchrun 'open", r"cannot split"),
        (["torchrun", 2], r"expected a string or a list of strings"),
        (7, r"expected a string or a list of strings"),
    ],
    ids=[
        "semicolon",
        "pipe",
        "and",
        "redirect",
        "variable",
        "backtick",
        "subshell",
        "glob",
        "tilde",
        "newline",
        "quote",
        "empty-arg",
        "open-quote",
        "not-str-item",
        "number",
    ],
)
def test_shell_syntax_and_bad_values_are_refused(command: object, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^command: .*{message}"):
        parse_command(command)  # type: ignore[arg-type]


def test_the_refusal_says_the_command_runs_without_a_shell() -> None:
    with pytest.raises(ValueError, match=r"runs without a shell.*torchrun --standalone --nproc_per_node 2"):
        parse_command("torchrun | tee")


# ----------------------------------------------------------------------------- resolve_command


def test_python_and_torchrun_are_this_environments() -> None:
    assert resolve_command([]) == [sys.executable]
    assert resolve_command(["python", "-u"]) == [sys.executable, "-u"]
    assert resolve_command(["python3"]) == [sys.executable]
    assert resolve_command(["torchrun", "--nproc_per_node", "2"]) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
    ]


def test_another_program_is_looked_up_on_path() -> None:
    assert resolve_command(["env", "-i"]) == [shutil.which("env"), "-i"]


def test_an_absolute_program_must_be_an_executable_file(tmp_path: Path) -> None:
    program = tmp_path / "launch"
    program.write_text("#!/bin/sh\n")

    with pytest.raises(FileNotFoundError, match=r"command: '.*launch' is not an executable file"):
        resolve_command([str(program)])
    program.chmod(0o755)
    assert resolve_command([str(program), "-x"]) == [str(program), "-x"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such-launcher-3f9a"], r"program 'no-such-launcher-3f9a' not found on PATH; install it"),
        (["bin/launch"], r"'bin/launch' is a relative path; give the program's absolute path"),
        (["/no/such/launcher"], r"'/no/such/launcher' is not an executable file"),
    ],
    ids=["not-on-path", "relative", "missing-file"],
)
def test_a_program_that_cannot_run_is_refused_naming_the_key(argv: list[str], message: str) -> None:
    with pytest.raises(FileNotFoundError, match=rf"^command: {message}"):
        resolve_command(argv)


def test_the_script_does_not_inherit_the_ranks_of_a_launch_the_client_runs_in() -> None:
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "PATH": "/bin"}

    assert script_environment(environ) == {"PATH": "/bin"}


# ----------------------------------------------------------------------------- the executor's `command`


def test_a_command_needs_subprocess_mode() -> None:
    with pytest.raises(
        ValueError,
        match=r"^command: 'torchrun' launches the script as its own process; set "
        r"execution_mode = subprocess",
    ):
        ClientAPIExecutor(task_script_path="train.py", command="torchrun")


def test_the_executor_refuses_shell_syntax_in_its_command() -> None:
    with pytest.raises(ValueError, match=r"^command: "):
        ClientAPIExecutor(task_script_path="train.py", execution_mode="subprocess", command="python train.py | tee")


def test_initialize_refuses_a_program_it_cannot_find(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    executor = ClientAPIExecutor(
        task_script_path="train.py", execution_mode="subprocess", command="no-such-launcher-3f9a"
    )

    with pytest.raises(FileNotFoundError, match=r"^command: program 'no-such-launcher-3f9a' not found on PATH"):
        executor.initialize(ExecutorContext("site-1", "job-1", workspace=tmp_path, custom_dir=tmp_path))


def test_the_command_runs_the_script_with_its_arguments_and_a_crash_reports_its_error(tmp_path: Path) -> None:
    """``python -X dev`` (a real launcher prefix) runs the script; its error lines reach the reason."""
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""
        import sys
        from engine import client as flare

        flare.init()
        model = flare.receive(timeout=10)
        print("some progress", file=sys.stderr)
        raise RuntimeError(f"boom with dev mode={sys.flags.dev_mode} args={sys.argv[1:]}")
    """)
    )
    executor = ClientAPIExecutor(
        task_script_path="train.py", task_script_args="--lr 0.1", execution_mode="subprocess", command="python -X dev"
    )
    executor.initialize(ExecutorContext("site-1", "job-1", workspace=tmp_path, custom_dir=tmp_path))
    try:
        result = executor.execute("train", shareable_from_model(FLModel(params={"w": 1.0})), threading.Event())
    finally:
        executor.finalize()

    assert result.get_return_code() is ReturnCode.EXECUTION_EXCEPTION
    reason = result.get_header(REASON_HEADER)
    assert reason.startswith("train.py exited with code 1 before answering the task; errors: "), reason
    assert "RuntimeError: boom with dev mode=True args=['--lr', '0.1']" in reason


# ----------------------------------------------------------------------------- StderrTail

TORCHRUN_STDERR = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/train.py", line 4, in <module>
[rank1]:     raise RuntimeError("rank 1 failed on purpose")
[rank1]: RuntimeError: rank 1 failed on purpose
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/train.py", line 5, in <module>
[rank0]:     dist.barrier()
[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:17301.
W1125 19:55:00.136000 19756 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process closing signal
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 19812)
============================================================
"""


def test_the_tail_keeps_the_first_error_the_last_ones_and_the_last_lines() -> None:
    tail = StderrTail(forward=None)
    for line in TORCHRUN_STDERR.splitlines(keepends=True):
        tail.add(line.encode())

    assert tail.summary() == (
        "errors: [rank1]: RuntimeError: rank 1 failed on purpose"
        " | [rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:17301."
        " | torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
        "; stderr ends: rank      : 1 (local_rank: 1) | exitcode  : 1 (pid: 19812)"
        " | ============================================================"
    )


def test_the_tail_escapes_terminal_controls_and_cuts_long_lines() -> None:
    tail = StderrTail(forward=None)
    tail.add(b"ValueError: \x1b[31mred\x1b[0m " + b"x" * 1000 + b"\n")

    summary = tail.summary()
    assert "\x1b" not in summary and "\\x1b[31mred" in summary
    assert len(summary) < 400 and summary.endswith("...")


def test_an_empty_stderr_says_so() -> None:
    assert StderrTail(forward=None).summary() == "nothing on its stderr"


def test_the_tail_forwards_every_line_and_reads_to_the_end(tmp_path: Path) -> None:
    source, copy = tmp_path / "err.txt", tmp_path / "copy.txt"
    source.write_bytes(b"line one\n\nKeyError: 'w'\nlast line without newline")
    with copy.open("wb") as forward:
        tail = StderrTail(forward=forward)
        tail.follow(source.open("rb"))
        tail.wait(5.0)

    assert copy.read_bytes() == source.read_bytes()
    assert tail.summary() == "errors: KeyError: 'w'; stderr ends: line one | last line without newline"
