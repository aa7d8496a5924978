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
import collections
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from engine import __version__
from engine.config import Problem, validate_job
from engine.config.problems import format_key_path
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
        _print_json(_error_document(f"{e.parser.prog}: {e.message}", UsageError.exit_code))
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
            _print_json(_error_document(str(e), e.exit_code, problems))
        return e.exit_code
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        if as_json:
            _print_json(_error_document("interrupted", 130))
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


class _BadArguments(Exception):
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


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, default=str))


def _error_document(message: str, exit_code: int, problems: Sequence[Problem] | None = None) -> dict[str, Any]:
    document: dict[str, Any] = {"error": message, "exit_code": exit_code}
    if problems is not None:
        document["problems"] = [_problem_json(problem) for problem in problems]
    return document


def _problem_json(problem: Problem) -> dict[str, Any]:
    return {
        "file": problem.file,
        "line": problem.line,
        "key_path": format_key_path(problem.key_path),
        "message": problem.message,
        "hint": problem.hint,
    }


def _add_verbose(parser: argparse.ArgumentParser, text: str = "log debug messages to stderr") -> None:
    """``-v`` after the command too; SUPPRESS keeps the subcommand from resetting a ``-v`` given before it."""
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=text)


def _add_format(parser: argparse.ArgumentParser, text: str = "text (default) or json") -> None:
    parser.add_argument("--format", choices=("text", "json"), default="text", help=text)


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
    _add_format(validate, "text (one line per problem, default) or json (one document on stdout)")
    _add_verbose(validate)
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
            "goes to stderr and stdout gets summary.json's document alone. Exits 0 only when the job "
            "finished completed, 130 when interrupted, 2 on a usage error, 1 otherwise."
        ),
    )
    run.add_argument("job", metavar="JOB", help="a job folder, e.g. jobs/fedavg")
    run.add_argument("-n", "--clients", type=int, default=None, metavar="N", help="clients (default: min_clients)")
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
    _add_format(
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
    _add_verbose(
        run,
        "debug logging: every process's log lines on stderr as they are written ('site-1 | ...', each also "
        "in WORKSPACE/<site>/log.txt)",
    )
    run.set_defaults(handler=_run)
    _add_report_command(commands)
    _add_new_command(commands)
    _add_provision_command(commands)
    _add_deploy_commands(commands)
    _add_poc_commands(commands)
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
    _add_format(report, "text (the file written, default) or json")
    _add_verbose(report)
    report.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from engine.report import write_report  # matplotlib loads only for this command

    report = write_report(args.workspace, args.output)
    if args.format == "json":
        _print_json(report.to_json())
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
        "-t",
        "--template",
        choices=tuple(TEMPLATES),
        default=DEFAULT_TEMPLATE,
        help=f"{', '.join(TEMPLATES)} (default: {DEFAULT_TEMPLATE})",
    )
    new.add_argument(
        "--dir", default=".", metavar="DIR", help="the folder the job folder goes in (default: the current folder)"
    )
    new.add_argument(
        "--rounds", type=int, default=None, metavar="N", help="rounds of training (default: the template's, 3)"
    )
    _add_format(new, "text (the files written, default) or json")
    _add_verbose(new)
    new.set_defaults(handler=_new)


def _new(args: argparse.Namespace) -> int:
    from engine.config.new_job import new_job

    job = new_job(args.name, args.template, args.dir, args.rounds)
    if args.format == "json":
        _print_json({"job": str(job.folder), "template": job.template, "files": job.files})
        return 0
    print(f"wrote job {args.name} ({job.template}) in {job.folder}:")
    for file in job.files:
        print(f"  {file}")
    print(f"next: flengine validate {job.folder} && flengine run {job.folder}")
    return 0


def _add_deploy_commands(commands: argparse._SubParsersAction) -> None:
    for role, what in (("server", "the server"), ("client", "a site's client")):
        parser = commands.add_parser(role, help=f"run {what} of a provisioned project (production mode)")
        actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
        start = actions.add_parser(
            "start",
            help=f"run {what} from its startup kit until stopped (SIGTERM, Ctrl-C or an admin's shutdown)",
            description=(
                f"Run {what} from its startup kit (checked against its MANIFEST.json first) in the "
                "foreground until SIGTERM, Ctrl-C or an admin's shutdown. Its log goes to "
                "WORKSPACE/log.txt."
            ),
        )
        start.add_argument("kit", metavar="KIT", help="the startup kit folder that flengine provision wrote")
        start.add_argument(
            "--workspace",
            default=None,
            metavar="DIR",
            help="where jobs and logs go (default: <kit>/../<name>-workspace)",
        )
        _add_verbose(start, "log debug messages too, to WORKSPACE/log.txt (where every log message of it goes)")
        start.set_defaults(handler=_server_start if role == "server" else _client_start)
    admin = commands.add_parser(
        "admin",
        help="run one admin command on the server of a provisioned project",
        description=(
            "Run one command on the server with an admin's startup kit: submit JOB_FOLDER (checked "
            "here first; prints the job id), list, status JOB, abort JOB, delete JOB, download JOB "
            "[-o DIR], logs JOB [SITE], clients, shutdown [SITE|all]. Exits 0 when the command succeeded, 1 when the "
            "server refused or failed it, 2 on a usage error."
        ),
    )
    admin.add_argument("kit", metavar="KIT", help="the admin's startup kit folder")
    admin.add_argument(
        "command",
        metavar="COMMAND",
        choices=("submit", "list", "status", "abort", "delete", "download", "logs", "clients", "shutdown"),
        help="submit, list, status, abort, delete, download, logs, clients or shutdown",
    )
    admin.add_argument("args", nargs="*", metavar="ARG", help="its arguments: a job folder, a job id, a site")
    admin.add_argument("-o", "--output", default=None, metavar="DIR", help="download: where results go (default: .)")
    _add_format(admin)
    _add_verbose(admin)
    admin.set_defaults(handler=_admin)


def _server_start(args: argparse.Namespace) -> int:
    from engine.deploy.console import run_server

    return run_server(args.kit, args.workspace, verbose=args.verbose)


def _client_start(args: argparse.Namespace) -> int:
    from engine.deploy.console import run_client

    return run_client(args.kit, args.workspace, verbose=args.verbose)


def _add_poc_commands(commands: argparse._SubParsersAction) -> None:
    poc = commands.add_parser(
        "poc",
        help="try production mode on this machine: a server, N sites and an admin as local processes",
        description=(
            "POC mode: a provisioned project on 127.0.0.1 in one folder (default ./poc): project.conf, "
            "kits/<name>/, workspaces/<name>/ (daemon.txt is each daemon's output) and run/<name>.pid. "
            "Then: flengine admin poc/kits/admin submit jobs/fedavg."
        ),
    )
    actions = poc.add_subparsers(title="actions", metavar="ACTION", required=True)
    helps = {
        "prepare": "write the project file and the kits: server on 127.0.0.1, site-1..site-N, admin 'admin' "
        "(again after editing project.conf: existing keys are kept)",
        "start": "start the server and every site in the background; wait until every site is connected",
        "status": "which daemons run (pid) and, from the server, which sites are connected; exits 1 unless all are up",
        "stop": "stop exactly the processes `poc start` started (sites first, then the server); SIGKILL after 20 s",
    }
    for action, text in helps.items():
        parser = actions.add_parser(action, help=text, description=text[:1].upper() + text[1:] + ".")
        parser.add_argument("-o", "--folder", default=None, metavar="DIR", help="the POC folder (default: ./poc)")
        _add_format(parser)
        _add_verbose(parser)
        if action == "prepare":
            parser.add_argument(
                "-n",
                "--sites",
                type=int,
                default=None,
                metavar="N",
                help="sites site-1..site-N (default: 2, or as many as project.conf has)",
            )
            parser.add_argument(
                "--port",
                type=int,
                default=None,
                metavar="P",
                help="the server's port; it takes P..P+10, which must be free (default: 8002, or project.conf's)",
            )
        parser.set_defaults(handler=_poc, action=action)


def _poc(args: argparse.Namespace) -> int:
    from engine.deploy.poc.console import run_poc

    return run_poc(args.action, args.folder, args.format, getattr(args, "sites", None), getattr(args, "port", None))


def _admin(args: argparse.Namespace) -> int:
    from engine.deploy.console import run_admin

    return run_admin(args.kit, args.command, args.args, args.output, args.format)


def _add_provision_command(commands: argparse._SubParsersAction) -> None:
    provision = commands.add_parser(
        "provision",
        help="write a startup kit for every participant of a project file (server, sites, admins)",
        description=(
            "Read a project file (HOCON or JSON: the server's host and port, the sites, the admins) "
            "and write one startup kit per participant under DIR/<name>/: its key pair, the keys it "
            "trusts, kit.json, start.sh, a site's policy.conf and MANIFEST.json. Run it again with the "
            "same DIR after editing the project file: new participants get new kits, existing keys are "
            "kept byte for byte, and the server's allowlist and every changed kit are updated."
        ),
    )
    provision.add_argument("project", metavar="PROJECT", help="the project file, e.g. docs/project.conf")
    provision.add_argument(
        "-o", "--output", required=True, metavar="DIR", help="where the kits go (new, or the one used before)"
    )
    provision.add_argument(
        "--remove",
        action="store_true",
        help="revoke participants the project file no longer names: off the server's allowlist, kit deleted",
    )
    _add_format(provision, "text (one line per kit, default) or json")
    _add_verbose(provision)
    provision.set_defaults(handler=_provision)


def _run(args: argparse.Namespace) -> int:
    from engine.runtime.simulator import run_simulation  # torch and zmq load only for this command

    as_json = args.format == "json"
    with contextlib.ExitStack() as stack:
        if args.quiet and as_json:
            progress = stack.enter_context(open(os.devnull, "w", encoding="utf-8"))
        else:
            progress = sys.stderr if as_json else sys.stdout  # stdout holds the JSON document alone
        result = run_simulation(
            args.job,
            args.clients,
            args.workspace,
            out=progress,
            verbose=args.verbose,
            allowed_dirs=args.allow_dirs,
            live=False if args.quiet else None,
        )
    if as_json:
        _print_json(result.summary)
    return result.exit_code


def _provision(args: argparse.Namespace) -> int:
    from engine.provision import inspect_project, provision  # zmq loads only for this command

    project, problems = inspect_project(args.project)
    if project is None:
        message = f"{args.project}: {_count(problems, 'problem')}; nothing was written"
        print(f"Error: {message}", file=sys.stderr)
        for problem in problems:
            print(problem, file=sys.stderr)
        if args.format == "json":
            _print_json(_error_document(message, ConfigError.exit_code, problems))
        return ConfigError.exit_code
    report = provision(project, Path(args.output), remove=args.remove)
    if args.format == "json":
        _print_json(report.to_json())
        return 0
    width = max(len(kit.identity) for kit in report.kits)
    for kit in report.kits:
        what = "key revoked, kit deleted" if kit.status == "removed" else str(kit.folder)
        changed = f": {', '.join(kit.files)}" if kit.status == "updated" else ""
        print(f"{kit.status:<8} {kit.identity:<{width}}  {kit.kind:<6}  {what}{changed}")
    counts = collections.Counter(kit.status for kit in report.kits)
    summary = ", ".join(
        f"{counts[status]} {status}" for status in ("created", "updated", "kept", "removed") if counts[status]
    )
    advice = (
        "send each created or updated kit to its owner, privately (it holds the owner's secret key)"
        if counts["created"] or counts["updated"]
        else "nothing to send"
    )
    print(f"project {report.project}: {summary}; {advice}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    as_json = args.format == "json"
    checked = []
    for job in args.jobs:
        problems = _validate_project(job) if Path(job).is_file() else validate_job(job)
        checked.append({"job": job, "ok": not problems, "problems": [_problem_json(p) for p in problems]})
        if as_json:
            continue
        for problem in problems:
            print(problem)
        print(f"{job}: {_count(problems, 'problem')}" if problems else f"{job}: ok")
    invalid = sum(not entry["ok"] for entry in checked)
    if as_json:
        _print_json({"jobs": checked, "checked": len(checked), "invalid": invalid})
    elif len(args.jobs) > 1:
        print(f"{len(args.jobs)} jobs checked, {invalid} invalid")
    return 1 if invalid else 0


def _count(items: Sequence[object], what: str) -> str:
    return f"{len(items)} {what}{'s' if len(items) != 1 else ''}"


def _validate_project(path: str) -> list[Problem]:
    from engine.provision import validate_project  # zmq loads only for project files

    return validate_project(path)
