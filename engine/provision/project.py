"""The project file: who takes part in a federation (the server, the sites, the admins).

A project file is HOCON (``.conf``) or JSON, checked against ``schemas/project.schema.json`` and
then for what a schema cannot say: names are identities, unique across the server, sites and
admins (ignoring case, since each becomes a folder), ``server`` belongs to the server alone, and
one admin is a ``project_admin``. Every problem names the file, line and key path::

    docs/project.conf:14: sites[1].name: duplicate name 'site-1', first used at sites[0].name (line 12) (...)
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from engine.config import ConfigDocument, KeyPath, Problem, load_config
from engine.config.problems import format_key_path
from engine.config.schema import check_document
from engine.errors import ConfigError

Kind = Literal["server", "site", "admin"]
#: Admin roles, from most to least powerful (as in NVIDIA FLARE's authorization model).
ROLES = ("project_admin", "org_admin", "lead", "member")
#: The name only the server may have: every client kit holds the server's key as ``server.key``.
SERVER_NAME = "server"
_ALL_INTERFACES = "0.0.0.0"


@dataclasses.dataclass(frozen=True)
class Participant:
    """One identity of a project: the server, a site or an admin user.

    Attributes:
        name: The identity (a cell name without dots); its kit folder and key files carry it.
        kind: ``server``, ``site`` or ``admin``.
        org: The organisation it belongs to.
        role: An admin's role (one of `ROLES`); None for the server and sites.
        resources: What a site offers jobs (``num_gpus``, ``memory_gb``, ...); empty otherwise.
    """

    name: str
    kind: Kind
    org: str
    role: str | None = None
    resources: dict[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """The participant as the server's ``participants.json`` lists it (without its name)."""
        entry: dict[str, Any] = {"kind": self.kind, "org": self.org}
        if self.role is not None:
            entry["role"] = self.role
        if self.kind == "site":
            entry["resources"] = dict(self.resources)
        return entry


@dataclasses.dataclass(frozen=True)
class ServerAddress:
    """Where the server is: what clients connect to and what the server binds.

    Attributes:
        name: The server's identity.
        host: Host name or address that sites and admins connect to.
        port: TCP port, 1..65535.
        bind_host: Address the server binds to.
    """

    name: str
    host: str
    port: int
    bind_host: str

    @property
    def connect_address(self) -> str:
        """The ZeroMQ endpoint a client connects to, e.g. ``tcp://fl.example.org:8002``."""
        return f"tcp://{self.host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class Project:
    """A checked project file.

    Attributes:
        name: The project's name.
        server: The server's address.
        participants: Everyone, the server first, then the sites and the admins in file order.
        source: The project file as the user named it.
    """

    name: str
    server: ServerAddress
    participants: tuple[Participant, ...]
    source: str = ""

    def participant(self, name: str) -> Participant:
        """The participant called ``name`` (KeyError when there is none)."""
        for participant in self.participants:
            if participant.name == name:
                return participant
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        """Every participant's name, the server first."""
        return [participant.name for participant in self.participants]


def inspect_project(path: str | os.PathLike[str]) -> tuple[Project | None, list[Problem]]:
    """Read and check a project file.

    Returns:
        The project (None when anything is wrong) and every problem found, in file order.
    """
    display = os.fspath(path)
    file = Path(path)
    if not file.is_file():
        what = "not a file" if file.exists() else "no such file"
        return None, [Problem(display, None, (), what, "give the path of a project file, e.g. project.conf")]
    try:
        document = load_config(file, display, file.resolve().parent)
    except ConfigError as e:
        return None, list(e.problems)
    problems = check_document(document, "project")
    reported = {problem.key_path for problem in problems}
    # what the schema cannot say, checked on whatever is well-formed; a key faulted once is said once
    problems += [p for p in _check_names(document) + _check_hosts(document) if p.key_path not in reported]
    if problems:
        return None, sorted(problems, key=lambda p: p.line or 0)
    return _project_of(document), []


def load_project(path: str | os.PathLike[str]) -> Project:
    """Read and check a project file; raise `ConfigError` listing every problem if it is not valid."""
    project, problems = inspect_project(path)
    if project is None:
        raise ConfigError(problems)
    return project


def validate_project(path: str | os.PathLike[str]) -> list[Problem]:
    """Return every problem of a project file (an empty list when it is valid)."""
    return inspect_project(path)[1]


def default_bind_host(host: str) -> str:
    """The address a server binds by default: ``host`` when it is an IP address, else all interfaces."""
    return host if _is_ip_address(host) else _ALL_INTERFACES


def _project_of(document: ConfigDocument) -> Project:
    data = document.data
    server = data["server"]
    name = server.get("name", SERVER_NAME)
    address = ServerAddress(
        name, server["host"], server["port"], server.get("bind_host", default_bind_host(server["host"]))
    )
    participants = [Participant(name, "server", server["org"])]
    participants += [
        Participant(s["name"], "site", s["org"], resources=dict(s.get("resources", {}))) for s in data["sites"]
    ]
    participants += [Participant(a["name"], "admin", a["org"], role=a["role"]) for a in data["admins"]]
    return Project(data["name"], address, tuple(participants), document.display)


def _named_entries(data: dict[str, Any]) -> Iterator[tuple[KeyPath, str]]:
    """Yield ``(key path of the name, name)`` for the server, every site and every admin that has one."""
    server = data.get("server")
    if isinstance(server, dict):
        yield ("server", "name"), server.get("name", SERVER_NAME)
    for key in ("sites", "admins"):
        entries = data.get(key)
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                yield (key, i, "name"), entry["name"]


def _check_names(document: ConfigDocument) -> list[Problem]:
    problems = []
    first_seen: dict[str, KeyPath] = {}
    for key_path, name in _named_entries(document.data):
        if not isinstance(name, str):
            continue
        if name.lower() == SERVER_NAME and key_path[0] != "server":
            problems.append(
                document.problem(
                    key_path,
                    f"{name!r} is reserved for the server",
                    "give this participant another name; every kit keeps the server's key as server.key",
                )
            )
            continue
        folded = name.lower()
        if folded in first_seen:
            first = first_seen[folded]
            line = document.line_of(first)
            where = format_key_path(first) + (f" (line {line})" if line else "")
            problems.append(
                document.problem(
                    key_path,
                    f"duplicate name {name!r}, first used at {where}",
                    "names are identities: unique across the server, sites and admins, ignoring case",
                )
            )
        else:
            first_seen[folded] = key_path
    admins = document.data.get("admins")
    roles = [admin.get("role") for admin in admins if isinstance(admin, dict)] if isinstance(admins, list) else []
    if admins and "project_admin" not in roles and all(role in ROLES for role in roles):
        problems.append(
            document.problem(
                ("admins",),
                'no admin has role "project_admin"',
                "give one admin `role = project_admin`: the project's owner, who may do everything",
            )
        )
    return problems


def _check_hosts(document: ConfigDocument) -> list[Problem]:
    server = document.data.get("server")
    if not isinstance(server, dict):
        return []
    problems = []
    for key in ("host", "bind_host"):
        value = server.get(key)
        if not isinstance(value, str):
            continue
        if ":" in value and _is_ip_address(value):
            message, hint = "IPv6 addresses are not supported yet", "give a host name or an IPv4 address"
        elif key == "host" and ":" in value:
            message = f"{value!r} is not a host name or an IP address"
            hint = "write the host alone, e.g. fl.example.org, and the port as `port`"
        elif key == "bind_host" and not _is_ip_address(value):
            message = f"{value!r} is not an IP address"
            hint = "an address of the server's host, or 0.0.0.0 for all interfaces"
        else:
            continue
        problems.append(document.problem(("server", key), message, hint))
    return problems


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
