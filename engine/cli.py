"""The ``flengine`` command.

Every error flengine raises on purpose derives from `engine.errors.FlengineError`; it is caught
once here and printed as one ``Error: ...`` line with the error's exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from engine import __version__
from engine.config import validate_job
from engine.errors import FlengineError

_DESCRIPTION = """\
flengine runs federated-learning jobs described by folders of HOCON/JSON files.

A job folder holds meta.conf and one folder per app with config/config_fed_server.conf,
config/config_fed_client.conf and an optional custom/ folder of job code."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flengine`` command line and return its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.handler(args)
    except FlengineError as e:
        print(f"Error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flengine",
        description=_DESCRIPTION,
        epilog=(
            "examples:\n  flengine run jobs/fedavg     run the job: a server and 2 clients on this machine\n"
            "  flengine validate jobs/*     check every job of the jobs/ folder"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flengine {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    validate = commands.add_parser(
        "validate",
        help="check job folders against the schemas and dry-build their components",
        description=(
            "Check each job folder: its files against the JSON Schemas, then a dry build of every "
            "component (the dotted path imports, the args fit the constructor, ids are unique, "
            "deploy_map names existing app folders). Prints every problem as "
            "'file:line: key.path: what is wrong (hint)'. Exits 0 when every job is valid, 1 otherwise."
        ),
    )
    validate.add_argument(
        "jobs", nargs="+", metavar="JOB", help="a job folder, e.g. jobs/fedavg (several allowed: jobs/*)"
    )
    validate.set_defaults(handler=_validate)

    run = commands.add_parser(
        "run",
        help="run a job on this machine: a server and N client processes (the simulator)",
        description=(
            "Run a job folder with a server process and N client processes (site-1 .. site-N) that "
            "talk over ZeroMQ on 127.0.0.1. Shows progress while it runs and a summary at the end; "
            "logs, models and summary.json are left in the workspace. Exits 0 only when the job "
            "finished completed."
        ),
    )
    run.add_argument("job", metavar="JOB", help="a job folder, e.g. jobs/fedavg")
    run.add_argument("-n", "--clients", type=int, default=None, metavar="N", help="clients (default: min_clients)")
    run.add_argument(
        "--workspace", default=None, metavar="DIR", help="a new or empty folder (default: workspace/<job>-<time>)"
    )
    run.set_defaults(handler=_run)
    return parser


def _run(args: argparse.Namespace) -> int:
    from engine.runtime.simulator import run_simulation  # torch and zmq load only for this command

    return run_simulation(args.job, args.clients, args.workspace, verbose=args.verbose).exit_code


def _validate(args: argparse.Namespace) -> int:
    invalid = 0
    for job in args.jobs:
        problems = validate_job(job)
        for problem in problems:
            print(problem)
        if problems:
            invalid += 1
            print(f"{job}: {len(problems)} problem{'s' if len(problems) != 1 else ''}")
        else:
            print(f"{job}: ok")
    if len(args.jobs) > 1:
        print(f"{len(args.jobs)} jobs checked, {invalid} invalid")
    return 1 if invalid else 0
