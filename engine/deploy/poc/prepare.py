"""`prepare`: a POC's project file (server on 127.0.0.1, site-1 .. site-N, the admin) and its kits."""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile
from pathlib import Path
from typing import Any

from engine.deploy import protocol
from engine.deploy.folders import private_folder
from engine.deploy.poc.folder import ADMIN_NAME, HOST, PROJECT_NAME, PocError, PocFolder, read_daemons
from engine.deploy.ports import port_taken
from engine.errors import UsageError
from engine.provision import ProvisionReport, load_project, provision

#: The server's port when none is given; it takes the next `protocol.DEFAULT_JOB_PORTS` too.
DEFAULT_PORT = 8002
DEFAULT_SITES = 2
#: Ports the server takes from its own port on: the port itself and one per running job.
PORT_SPAN = 1 + protocol.DEFAULT_JOB_PORTS

_PROJECT_TEXT = """\
# The project of `flengine poc prepare`: a server, {sites} sites and one admin, all on this machine.
# Edit it (add sites, resources, admins) and run `flengine poc prepare -d DIR` again: the kits
# of existing participants keep their keys. Every key is in schemas/project.schema.json.
name = {project}

server {{ host = "{host}", port = {port}, org = {project} }}

sites = [
{site_lines}
]

admins = [
  {{ name = {admin}, org = {project}, role = project_admin }}
]
"""


@dataclasses.dataclass(frozen=True)
class PrepareReport:
    """What `prepare` wrote.

    Attributes:
        project_file: The project file.
        project_status: ``created``, ``updated`` (from -n / --port) or ``kept`` (used as it is).
        ports: The first and last port the server will take.
        provisioned: What provisioning did, per kit.
    """

    project_file: Path
    project_status: str
    ports: tuple[int, int]
    provisioned: ProvisionReport

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (``--format json``)."""
        return {
            "project_file": str(self.project_file),
            "project_status": self.project_status,
            "ports": list(self.ports),
            **self.provisioned.to_json(),
        }


def project_text(sites: int, port: int) -> str:
    """The project file `prepare` writes for ``sites`` sites and the server on ``port``."""
    site_lines = "\n".join(f"  {{ name = site-{i}, org = {PROJECT_NAME} }}" for i in range(1, sites + 1))
    return _PROJECT_TEXT.format(
        sites=sites, project=PROJECT_NAME, host=HOST, port=port, site_lines=site_lines, admin=ADMIN_NAME
    )


def prepare(folder: Path, sites: int | None = None, port: int | None = None) -> PrepareReport:
    """Write (or bring up to date) a POC's project file and kits.

    Args:
        folder: The POC folder; created when missing.
        sites: How many sites (``site-1`` ..); default 2 for a new POC, else what the project file says.
        port: The server's port (it takes the next 10 too); default 8002 for a new POC, else the file's.

    Raises:
        UsageError: ``sites`` or ``port`` out of range, or given for a project file edited by hand.
        PocError: The folder is not a POC folder, the POC runs, or the server's ports are taken.
    """
    poc = PocFolder(folder)
    if sites is not None and sites < 1:
        raise UsageError(f"-n {sites}: a POC needs at least one site")
    if port is not None and not 1024 <= port <= 65535 - PORT_SPAN + 1:
        raise UsageError(f"--port {port}: give a port in 1024..{65535 - PORT_SPAN + 1} (it takes the next 10 too)")
    _check_poc_folder(poc)
    running = [d.name for d in read_daemons(poc) if d.state == "running"]
    if running:
        raise PocError(f"{folder}: the POC runs ({', '.join(running)}); stop it first: flengine poc stop -d {folder}")
    text, status = _project_text_for(poc, sites, port)
    if status == "kept":
        project = load_project(poc.project_file)  # its problems name the file the user edits
    else:
        with tempfile.TemporaryDirectory(prefix="flengine-poc-") as scratch:  # written once provisioning worked
            draft = Path(scratch) / "project.conf"
            draft.write_text(text, encoding="utf-8")
            project = load_project(draft)
    first = project.server.port
    check_ports_free(project.server.bind_host, first, poc, "prepare")
    private_folder(folder)
    # the POC is this machine's sandbox: a site dropped from the project file loses its kit
    report = provision(project, poc.kits, remove=True)
    if status != "kept":
        _write_atomically(poc.project_file, text)
    private_folder(poc.run)
    return PrepareReport(poc.project_file, status, (first, first + PORT_SPAN - 1), report)


def _check_poc_folder(poc: PocFolder) -> None:
    folder = poc.folder
    if folder.exists() and not folder.is_dir():
        raise PocError(f"{folder}: not a folder; give -d a new folder for the POC")
    if folder.is_dir() and any(folder.iterdir()) and not poc.project_file.is_file():
        raise PocError(
            f"{folder}: not a POC folder (it holds files but no project.conf); give -d a new or empty folder"
        )


def _project_text_for(poc: PocFolder, sites: int | None, port: int | None) -> tuple[str, str]:
    """The project file's text to provision from, and whether it is ``created``, ``updated`` or ``kept``."""
    if not poc.project_file.is_file():
        return project_text(sites or DEFAULT_SITES, port or DEFAULT_PORT), "created"
    current = poc.project_file.read_text(encoding="utf-8")
    if sites is None and port is None:
        return current, "kept"
    project = load_project(poc.project_file)
    now_sites = sum(1 for p in project.participants if p.kind == "site")
    if current != project_text(now_sites, project.server.port):
        raise UsageError(
            f"{poc.project_file}: edited since `flengine poc prepare` wrote it, so -n and --port do not "
            f"rewrite it; change its sites or server.port and run `flengine poc prepare -d {poc.folder}` "
            "without them"
        )
    text = project_text(sites or now_sites, port or project.server.port)
    return text, "kept" if text == current else "updated"


def taken_ports(host: str, first: int, count: int) -> list[int]:
    """The ports of ``first .. first + count - 1`` that a server could not bind on ``host`` now.

    Probed as ZeroMQ binds (``SO_REUSEADDR``): a port held only by closed connections is free.
    """
    taken = []
    for port in range(first, first + count):
        try:
            if port_taken(host, port):
                taken.append(port)
        except OSError as e:
            raise PocError(f"cannot bind {host}:{port} to check it: {e.strerror or e}") from e
    return taken


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A port p such that p .. p + count - 1 are free on ``host`` now (a server and its job ports).

    Drawn below the kernel's ephemeral range: a port in it may be taken at any moment as the
    source port of an outgoing connection (a site's to the server, say), so a job port picked
    there could be in use by the time the job's process binds it.
    """
    below = min(_ephemeral_low(), 32768)
    if below - count <= 10_000:  # an unusual range that starts low: draw under Linux's default start
        below = 32768
    for _ in range(200):
        first = random.randrange(10_000, below - count)
        if not taken_ports(host, first, count):
            return first
    raise PocError(f"no block of {count} free ports on {host}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def check_ports_free(host: str, first: int, poc: PocFolder, command: str) -> None:
    """Raise `PocError` naming the ports of the server's block that are taken, and how to choose another."""
    taken = taken_ports(host, first, PORT_SPAN)
    if not taken:
        return
    last = first + PORT_SPAN - 1
    listed = ", ".join(map(str, taken))
    fix = (
        f"choose another block: flengine poc prepare -d {poc.folder} --port {first + 1000} "
        f"(or set server.port in {poc.project_file})"
    )
    raise PocError(
        f"port{'s' if len(taken) > 1 else ''} {listed} of {first}..{last} on {host} "
        f"{'are' if len(taken) > 1 else 'is'} in use; the server takes {first} and its jobs {first + 1}..{last}. "
        f"Stop what uses {'them' if len(taken) > 1 else 'it'}, or {fix}"
        + ("" if command == "prepare" else ", then start again")
    )


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
