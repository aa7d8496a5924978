"""The production-mode commands: ``provision``, ``server start``, ``client start``, ``admin``, ``poc``."""

from __future__ import annotations

import argparse
import collections
import logging
import sys
from pathlib import Path

from engine.cli.output import add_format, add_moved_flag, add_verbose, count, error_document, print_json
from engine.errors import ConfigError


def add_deploy_commands(commands: argparse._SubParsersAction) -> None:
    """``server start``, ``client start`` and ``admin``."""
    for role, what in (("server", "the server"), ("client", "a site's client")):
        parser = commands.add_parser(
            role,
            help=f"run {what} of a provisioned project (production mode)",
            description=(
                f"Run {what} of a project that flengine provision wrote the kits of (production mode): "
                f"flengine {role} start KIT. "
                + (
                    "The server keeps the job store, schedules the submitted jobs on the sites and answers "
                    "the admins' commands (flengine admin)."
                    if role == "server"
                    else "The client connects to the server of its kit, checks each job the server deploys "
                    "against the site's policy.conf and runs the jobs it accepts."
                )
            ),
        )
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
        add_verbose(start, "log debug messages too, to WORKSPACE/log.txt (where every log message of it goes)")
        start.set_defaults(handler=_server_start if role == "server" else _client_start)
    admin = commands.add_parser(
        "admin",
        help="run one admin command on the server of a provisioned project",
        description=(
            "Run one command on the server with an admin's startup kit: submit JOB_FOLDER (checked "
            "here first; prints the job id), list, status JOB, watch JOB (the job live until it ends: "
            "its round, each site's state and last result, each round's metrics), abort JOB, delete JOB, "
            "download JOB [-o DIR], logs JOB [SITE] [--follow], clients, shutdown [SITE|all]. With "
            "--format json a command prints one JSON document; watch and logs --follow print one JSON "
            "object per update, a line each. Exits 0 when the command succeeded (watch and logs --follow: "
            "when the job finished completed), 1 when the server refused or failed it (or the job did "
            "not complete), 2 on a usage error. A server that is not running, or whose port does not "
            "answer within 1.5 s, fails the command at once with one line."
        ),
    )
    admin.add_argument("kit", metavar="KIT", help="the admin's startup kit folder")
    admin.add_argument(
        "command",
        metavar="COMMAND",
        choices=("submit", "list", "status", "watch", "abort", "delete", "download", "logs", "clients", "shutdown"),
        help="submit, list, status, watch, abort, delete, download, logs, clients or shutdown",
    )
    admin.add_argument("args", nargs="*", metavar="ARG", help="its arguments: a job folder, a job id, a site")
    admin.add_argument("-o", "--output", default=None, metavar="DIR", help="download: where results go (default: .)")
    admin.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="logs: print new lines as they are written, until the job has ended (then exit 0 if it completed)",
    )
    add_format(admin)
    add_verbose(admin)
    admin.set_defaults(handler=_admin)


def _server_start(args: argparse.Namespace) -> int:
    from engine.deploy.console import run_server

    return run_server(args.kit, args.workspace, verbose=args.verbose)


def _client_start(args: argparse.Namespace) -> int:
    from engine.deploy.console import run_client

    return run_client(args.kit, args.workspace, verbose=args.verbose)


def add_poc_commands(commands: argparse._SubParsersAction) -> None:
    """``poc prepare|start|status|stop``."""
    poc = commands.add_parser(
        "poc",
        help="try production mode on this machine: a server, N sites and an admin as local processes",
        description=(
            "POC mode: a provisioned project on 127.0.0.1 in one folder (default ./poc, or -d DIR): "
            "project.conf, kits/<name>/, workspaces/<name>/ (daemon.txt is each daemon's output) and "
            "run/<name>.pid. The folder holds secret keys: keep it out of version control. Then: "
            "flengine admin poc/kits/admin submit jobs/fedavg."
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
        parser.add_argument("-d", "--folder", default=None, metavar="DIR", help="the POC folder (default: ./poc)")
        add_moved_flag(
            parser, "-o", "-o is --output in every flengine command; the POC folder is -d DIR (or --folder DIR)"
        )
        add_format(parser)
        add_verbose(parser)
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

    if not args.verbose:  # one command, one answer: a refused or lost connection is the one Error line
        logging.getLogger("engine.cells").setLevel(logging.CRITICAL)
    return run_admin(args.kit, args.command, args.args, args.output, args.format, follow=args.follow)


def add_provision_command(commands: argparse._SubParsersAction) -> None:
    """``provision PROJECT -o DIR``."""
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
    provision.add_argument(
        "--server-kit",
        default=None,
        metavar="[HOST:]DIR",
        help=(
            "where the server runs its kit (a folder, or HOST:PATH on another machine): also print the commands "
            "that replace it with the new server kit (the running server picks it up without a restart)"
        ),
    )
    add_format(provision, "text (one line per kit, default) or json")
    add_verbose(provision)
    provision.set_defaults(handler=_provision)


def _provision(args: argparse.Namespace) -> int:
    from engine.provision import inspect_project, provision  # zmq loads only for this command
    from engine.provision.rollout import rollout_commands

    project, problems = inspect_project(args.project)
    if project is None:
        message = f"{args.project}: {count(problems, 'problem')}; nothing was written"
        print(f"Error: {message}", file=sys.stderr)
        for problem in problems:
            print(problem, file=sys.stderr)
        if args.format == "json":
            print_json(error_document(message, ConfigError.exit_code, problems))
        return ConfigError.exit_code
    server_kit = Path(args.output) / project.server.name
    if args.server_kit is not None:  # a bad destination stops the command before anything is written
        rollout_commands(server_kit, args.server_kit, first=False)
    report = provision(project, Path(args.output), remove=args.remove)
    server = next(kit for kit in report.kits if kit.kind == "server")
    rollout = []
    if args.server_kit is not None and server.status != "kept":
        rollout = rollout_commands(server_kit, args.server_kit, first=server.status == "created")
    if args.format == "json":
        print_json({**report.to_json(), **({"rollout": rollout} if args.server_kit is not None else {})})
        return 0
    print("\n".join(report.table()))
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
    if args.server_kit is not None and not rollout:
        print(f"# the server kit did not change: nothing to roll out to {args.server_kit}")
    elif rollout:
        print(f"# roll the server kit out to {args.server_kit} (the running server picks it up, no restart):")
        print("\n".join(rollout))
    return 0
