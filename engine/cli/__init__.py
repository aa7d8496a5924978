"""The ``flengine`` command.

Every error flengine raises on purpose derives from `engine.errors.FlengineError`; it is caught
once here and printed as one ``Error: ...`` line with the error's exit code, never a traceback.
With ``--format json`` an error (a usage error too) is also printed on stdout as one JSON
document, ``{"error": ..., "exit_code": N}`` (plus ``"problems"`` for an invalid job or file),
so that stdout holds exactly one JSON document whatever happened.

Exit codes: 0 success; 1 a failed command (an invalid job, a job that did not complete, a
refused admin command; every `FlengineError` but one); 2 a usage error (`UsageError`, or
arguments argparse rejects); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from engine import __version__
from engine.cli.deploy import add_deploy_commands, add_poc_commands, add_provision_command
from engine.cli.output import (
    add_format,
    add_moved_flag,
    add_verbose,
    count,
    error_document,
    print_json,
    problem_json,
)
from engine.config import Problem, validate_job
from engine.errors import ConfigError, FlengineError, UsageError
from engine.text import printable

_DESCRIPTION = """\
flengine runs federated-learning jobs described by folders of HOCON/JSON files.

A job folder holds meta.conf and one folder per app with config/config_fed_server.conf,
config/config_fed_client.conf and an optional custom/ folder of job code."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flengine`` command line and return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _BadArguments as e:
        if not _json_requested(argv):
            argparse.ArgumentParser.error(e.parser, e.message)  # usage and message on stderr, exit 2
        print(f"{e.parser.prog}: error: {e.message}", file=sys.stderr)
        print_json(error_document(f"{e.parser.prog}: {e.message}", UsageError.exit_code))
        return UsageError.exit_code
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=_CurrentStderr(),
    )
    as_json = getattr(args, "format", "text") == "json"
    try:
        return args.handler(args)
    except FlengineError as e:
        print(f"Error: {e}", file=sys.stderr)
        if as_json:
            problems = e.problems if isinstance(e, ConfigError) else None
            print_json(error_document(str(e), e.exit_code, problems))
        return e.exit_code
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        if as_json:
            print_json(error_document("interrupted", 130))
        return 130


def console_main() -> NoReturn:
    """The ``flengine`` executable: `main`, then an exit that skips tearing torch down.

    A command that loaded torch (``run``, ``validate`` of a job whose components import it)
    would spend 0.3-0.6 s at exit unloading it; once the output is flushed and the exit
    handlers have run, nothing is left to do, so the process ends at once.
    """
    code = main()
    if "torch" not in sys.modules:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    atexit._run_exitfuncs()  # temp folders and other finalizers, as a normal exit would
    os._exit(code)


class _CurrentStderr:
    """``sys.stderr`` as it is at each write: `run`'s live display stands in for it, so a log line goes above it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _BadArguments(FlengineError):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    """Raises `_BadArguments` instead of exiting, so that `main` can answer in JSON when asked to."""

    def error(self, message: str) -> NoReturn:
        raise _BadArguments(self, message)


def _json_requested(argv: Sequence[str]) -> bool:
    """Whether the arguments ask for ``--format json``: a usage error must be answered in JSON too."""
    pairs = zip(argv, argv[1:], strict=False)
    return "--format=json" in argv or any(arg == "--format" and value == "json" for arg, value in pairs)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flengine",
        description=_DESCRIPTION,
        epilog=(
            "examples:\n  flengine run jobs/fedavg     run the job: a server and 2 clients on this machine\n"
            "  flengine validate jobs/*     check every job of the jobs/ folder\n"
            "  flengine report WORKSPACE    an HTML page of plots about the run (metrics, times, memory)\n"
            "  flengine new my-job          write a FedAvg job folder to start from (--template swarm|cse)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flengine {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help=(
            "log debug messages (also after the command) to stderr; `run` shows there the log lines of its "
            "server and client processes too (each also in WORKSPACE/<site>/log.txt); `server|client start` "
            "write theirs to WORKSPACE/log.txt"
        ),
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    validate = commands.add_parser(
        "validate",
        help="check job folders against the schemas and dry-build their components",
        description=(
            "Check each job folder: its files against the JSON Schemas, then a dry build of every "
            "component (the dotted path imports, the args fit the constructor, ids are unique, "
            "deploy_map names existing app folders). Prints every problem as "
            "'file:line: key.path: what is wrong (hint)', or with --format json one document: "
            '{"jobs": [{"job", "ok", "problems": [{"file", "line", "key_path", "message", "hint"}]}], '
            '"checked", "invalid"}. A file instead of a folder is checked as a project '
            "file of `flengine provision`. Exits 0 when every job is valid, 1 otherwise, 2 on a usage error."
        ),
    )
    validate.add_argument(
        "jobs",
        nargs="+",
        metavar="JOB",
        help="a job folder, e.g. jobs/fedavg (several allowed: jobs/*), or a project file such as docs/project.conf",
    )
    add_format(validate, "text (one line per problem, default) or json (one document on stdout)")
    add_verbose(validate)
    validate.set_defaults(handler=_validate)

    run = commands.add_parser(
        "run",
        help="run a job on this machine: a server and N client processes (the simulator)",
        description=(
            "Run a job folder with a server process and N client processes (site-1 .. site-N) that "
            "talk over ZeroMQ on 127.0.0.1. Shows progress while it runs (in a terminal, with rich installed: "
            "a live status line per site and a bar per download, leaving one line per round; elsewhere one "
            "line per round) and a summary at the end; "
            "logs, models and summary.json are left in the workspace. With --format json the progress "
            "goes to stderr and stdout gets summary.json's document alone. With --resume WORKSPACE, a run "
            "that was killed (or failed) goes on from its last completed round. Exits 0 only when the job "
            "finished completed, 130 when interrupted, 2 on a usage error, 1 otherwise."
        ),
    )
    run.add_argument("job", metavar="JOB", nargs="?", help="a job folder, e.g. jobs/fedavg")
    run.add_argument(
        "--resume",
        default=None,
        metavar="WORKSPACE",
        help=(
            "the workspace of a run that was killed: run its job again there, from the last completed "
            "round (same job folder and clients; no JOB, -n, --workspace or --allow-dir)"
        ),
    )
    run.add_argument("-n", "--clients", type=int, default=None, metavar="N", help="clients (default: min_clients)")
    run.add_argument(
        "-t",
        "--workers",
        type=int,
        default=None,
        metavar="W",
        help=(
            "run the N clients as virtual clients on W worker processes, one client's task at a time "
            "(for hundreds to tens of thousands of clients; docs/simulation.md); default: one process per client"
        ),
    )
    run.add_argument(
        "--backend",
        choices=["processes", "ray"],
        default="processes",
        help="with -t: where the workers run: processes of this machine (default), or Ray actors (flengine[ray])",
    )
    run.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="with --backend ray: an existing Ray cluster to join (default: a local Ray instance)",
    )
    run.add_argument(
        "--worker-cpus", type=float, default=None, metavar="N", help="with --backend ray: CPUs per worker actor"
    )
    run.add_argument(
        "--worker-gpus", type=float, default=None, metavar="N", help="with --backend ray: GPUs per worker actor"
    )
    run.add_argument(
        "--workspace", default=None, metavar="DIR", help="a new or empty folder (default: workspace/<job>-<time>)"
    )
    run.add_argument(
        "--allow-dir",
        dest="allow_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help=(
            "a folder outside the workspace that the job's paths may name (download_to_disk_dir, "
            "source_ckpt_file_full_name); repeat for several (default: none, the job stays in its "
            "folder and the workspace)"
        ),
    )
    add_format(
        run,
        "text (progress and a summary table on stdout, default) or json (progress on stderr, the summary "
        "as one JSON document on stdout)",
    )
    run.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help=(
            "no live display: one line per round and the summary, as in a pipe (with --format json: nothing "
            "but the JSON document)"
        ),
    )
    add_verbose(
        run,
        "debug logging: every process's log lines on stderr as they are written ('site-1 | ...', each also "
        "in WORKSPACE/<site>/log.txt)",
    )
    run.set_defaults(handler=_run)
    _add_report_command(commands)
    _add_new_command(commands)
    add_provision_command(commands)
    add_deploy_commands(commands)
    add_poc_commands(commands)
    return parser


def _add_report_command(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report",
        help="write one HTML page of plots about a finished run, from its workspace",
        description=(
            "Read the workspace a run left (`flengine run` prints where it is) and write one "
            "self-contained HTML file (plots as embedded PNG images; open it in any browser, mail "
            "it): the global and each site's metrics per round, each round's time split into "
            "sending, training, receiving and aggregating, a timeline of each site, every "
            "transfer's bytes and MiB/s, each process's memory over time and the cross-site "
            "evaluation matrix. What the workspace lacks is listed on the page. Needs matplotlib: "
            "pip install flengine[report]. With --format json one document: "
            '{"report": FILE, "sections": [{"id", "title", "series": {name: points}, "plotted", "note"}], '
            '"notes"}. Exits 0 when written, 2 when WORKSPACE is not a run\'s workspace or '
            "matplotlib is missing."
        ),
    )
    report.add_argument(
        "workspace", metavar="WORKSPACE", help="a run's workspace, e.g. workspace/fedavg-20260101-120000"
    )
    report.add_argument(
        "-o", "--output", default=None, metavar="FILE", help="where the page goes (default: WORKSPACE/report.html)"
    )
    add_format(report, "text (the file written, default) or json")
    add_verbose(report)
    report.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from engine.report import write_report  # matplotlib loads only for this command

    report = write_report(args.workspace, args.output)
    if args.format == "json":
        print_json(report.to_json())
        return 0
    drawn = [section for section in report.sections if section.png is not None]
    print(printable(f"report: {report.path} ({len(drawn)} of {len(report.sections)} plots)"))
    for section in report.sections:
        if section.png is None:  # names in notes come from the workspace: printed inert
            print(printable(f"  not shown: {section.title}: {section.note}", 400))
    for note in report.notes:
        print(printable(f"  note: {note}", 400))
    return 0


def _add_new_command(commands: argparse._SubParsersAction) -> None:
    from engine.config.new_job import DEFAULT_TEMPLATE, TEMPLATES

    new = commands.add_parser(
        "new",
        help="write a job folder to start from: FedAvg, Swarm or Swarm with cross-site evaluation",
        description=(
            "Write the job folder DIR/NAME from a template: meta.conf, app/config/*.conf (every key "
            "with a comment saying what it does and the usual alternatives) and app/custom/ (the "
            "digits MLP, its data and a training script written with the Client API). The job "
            "validates and runs as written: flengine run NAME. Templates: "
            + "; ".join(f"{name}: {what}" for name, what in TEMPLATES.items())
            + ". Exits 0 when written, 2 when NAME is not a plain folder name or DIR/NAME exists "
            "and is not empty."
        ),
    )
    new.add_argument("name", metavar="NAME", help="the job's folder and name, e.g. my-job (no slashes)")
    new.add_argument(
        "--template",
        choices=tuple(TEMPLATES),
        default=DEFAULT_TEMPLATE,
        help=f"{', '.join(TEMPLATES)} (default: {DEFAULT_TEMPLATE})",
    )
    add_moved_flag(new, "-t", "-t is --workers of `flengine run`; the template is --template NAME")
    new.add_argument(
        "--dir", default=".", metavar="DIR", help="the folder the job folder goes in (default: the current folder)"
    )
    new.add_argument(
        "--rounds", type=int, default=None, metavar="N", help="rounds of training (default: the template's, 3)"
    )
    add_format(new, "text (the files written, default) or json")
    add_verbose(new)
    new.set_defaults(handler=_new)


def _new(args: argparse.Namespace) -> int:
    from engine.config.new_job import new_job

    job = new_job(args.name, args.template, args.dir, args.rounds)
    if args.format == "json":
        print_json({"job": str(job.folder), "template": job.template, "files": job.files})
        return 0
    print(f"wrote job {args.name} ({job.template}) in {job.folder}:")
    for file in job.files:
        print(f"  {file}")
    print(f"next: flengine validate {job.folder} && flengine run {job.folder}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from engine.runtime.simulator import resume_simulation, run_simulation  # torch and zmq load only here

    if args.resume is not None:
        given = [name for name, value in (("JOB", args.job), ("-n", args.clients), ("--workspace", args.workspace),
                 ("--allow-dir", args.allow_dirs), ("-t", args.workers)) if value]  # fmt: skip
        if given:
            raise UsageError(f"--resume takes the run's own settings from its workspace; drop {', '.join(given)}")
    elif args.job is None:
        raise UsageError("flengine run: give a job folder (JOB), or --resume WORKSPACE")
    as_json = args.format == "json"
    with contextlib.ExitStack() as stack:
        if args.quiet and as_json:
            progress = stack.enter_context(open(os.devnull, "w", encoding="utf-8"))
        else:
            progress = sys.stderr if as_json else sys.stdout  # stdout holds the JSON document alone
        live = False if args.quiet else None
        if args.resume is not None:
            result = resume_simulation(args.resume, out=progress, verbose=args.verbose, live=live)
        else:
            result = run_simulation(
                args.job,
                args.clients,
                args.workspace,
                out=progress,
                verbose=args.verbose,
                allowed_dirs=args.allow_dirs,
                live=live,
                workers=args.workers,
                backend=_backend(args),
            )
    if as_json:
        print_json(result.summary)
    return result.exit_code


def _backend(args: argparse.Namespace) -> Any:
    """The workers' backend the run's options ask for (None: processes of this machine)."""
    ray_options = [name for name, value in (("--ray-address", args.ray_address), ("--worker-cpus", args.worker_cpus),
                   ("--worker-gpus", args.worker_gpus)) if value is not None]  # fmt: skip
    if args.backend != "ray":
        if ray_options:
            raise UsageError(f"{', '.join(ray_options)}: only with --backend ray")
        return None
    if args.workers is None:
        raise UsageError("--backend ray runs virtual clients on workers: give -t W (how many workers)")
    from engine.runtime.ray_backend import RayWorkers

    return RayWorkers(address=args.ray_address, cpus=args.worker_cpus, gpus=args.worker_gpus)


def _validate(args: argparse.Namespace) -> int:
    as_json = args.format == "json"
    checked = []
    for job in args.jobs:
        problems = _validate_project(job) if Path(job).is_file() else validate_job(job)
        checked.append({"job": job, "ok": not problems, "problems": [problem_json(p) for p in problems]})
        if as_json:
            continue
        for problem in problems:
            print(problem)
        print(f"{job}: {count(problems, 'problem')}" if problems else f"{job}: ok")
    invalid = sum(not entry["ok"] for entry in checked)
    if as_json:
        print_json({"jobs": checked, "checked": len(checked), "invalid": invalid})
    elif len(args.jobs) > 1:
        print(f"{len(args.jobs)} jobs checked, {invalid} invalid")
    return 1 if invalid else 0


def _validate_project(path: str) -> list[Problem]:
    from engine.provision import validate_project  # zmq loads only for project files

    return validate_project(path)
