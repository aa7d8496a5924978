"""The POC folder: where a POC's files are, and what runs of it (read from its kits and pid files)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from engine.deploy.pidfile import ProcessRecord, read_pid_file
from engine.errors import PocError as PocError  # where callers import it from
from engine.provision import KIT_FILE, Kit
from engine.provision.kit import parse_kit_file

#: The POC folder when none is given: ``poc`` in the current folder.
DEFAULT_FOLDER = Path("poc")
PROJECT_NAME = "poc"
ADMIN_NAME = "admin"
HOST = "127.0.0.1"
_LOG_FILE = "daemon.txt"


@dataclasses.dataclass(frozen=True)
class PocFolder:
    """Where a POC's files are; ``folder`` is kept as the user gave it, for messages and commands to copy."""

    folder: Path

    @property
    def project_file(self) -> Path:
        """``project.conf``."""
        return self.folder / "project.conf"

    @property
    def kits(self) -> Path:
        """The kits folder."""
        return self.folder / "kits"

    @property
    def run(self) -> Path:
        """The pid files' folder."""
        return self.folder / "run"

    def kit(self, name: str) -> Path:
        """The kit of ``name``."""
        return self.kits / name

    def workspace(self, name: str) -> Path:
        """The workspace of ``name``'s daemon."""
        return self.folder / "workspaces" / name

    def log(self, name: str) -> Path:
        """The stdout and stderr of ``name``'s daemon."""
        return self.workspace(name) / _LOG_FILE

    def pid_file(self, name: str) -> Path:
        """The pid file of ``name``'s daemon."""
        return self.run / f"{name}.pid"


@dataclasses.dataclass(frozen=True)
class Daemon:
    """One daemon of a POC as a command found it.

    Attributes:
        name: The participant (``server``, ``site-1`` ...).
        kind: ``server`` or ``site``.
        state: ``running``; ``stopped`` (no pid file); ``stale`` (a pid file whose process ended or
            whose pid is another process now); for `stop`, ``stopped`` or ``killed`` once ended by it,
            or ``still running`` when not even SIGKILL ended it.
        pid: The recorded pid, when there is a pid file.
        log: Its ``daemon.txt``.
        site: For a site, the server's ``clients`` entry (``connected``, ``last_status_s``, ``jobs``).
    """

    name: str
    kind: str
    state: str
    pid: int | None
    log: Path
    site: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The daemon as plain data (``--format json``)."""
        data: dict[str, Any] = {"name": self.name, "kind": self.kind, "state": self.state, "pid": self.pid}
        data["log"] = str(self.log)
        if self.site is not None:
            data.update({key: self.site.get(key) for key in ("connected", "last_status_s", "jobs")})
        return data


@dataclasses.dataclass(frozen=True)
class PocReport:
    """What a POC command found or did.

    Attributes:
        folder: The POC folder.
        server: The server's endpoint, e.g. ``tcp://127.0.0.1:8002`` (empty when not prepared).
        daemons: The server first, then the sites.
        admin_kit: The admin kit to submit jobs with.
        started: The daemons this command started (`start`).
        server_error: Why the server's ``clients`` answer is missing, when the server runs.
    """

    folder: Path
    server: str
    daemons: tuple[Daemon, ...]
    admin_kit: Path | None = None
    started: tuple[str, ...] = ()
    server_error: str | None = None

    @property
    def all_up(self) -> bool:
        """Whether every daemon runs and every site is connected."""
        return bool(self.daemons) and all(
            d.state == "running" and (d.kind != "site" or bool(d.site and d.site.get("connected")))
            for d in self.daemons
        )

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (``--format json``)."""
        return {
            "folder": str(self.folder),
            "server": self.server,
            "admin_kit": str(self.admin_kit) if self.admin_kit else None,
            "started": list(self.started),
            "all_up": self.all_up,
            "server_error": self.server_error,
            "daemons": [daemon.to_json() for daemon in self.daemons],
        }


def prepared(folder: Path) -> PocFolder:
    """The POC folder ``folder``, checked to hold a prepared POC.

    Raises:
        PocError: It holds no ``project.conf`` and ``kits/`` (the message says to run ``poc prepare``).
    """
    poc = PocFolder(folder)
    if not poc.project_file.is_file() or not poc.kits.is_dir():
        where = "no such folder" if not folder.exists() else "no project.conf and kits/ there"
        raise PocError(f"{folder}: not a prepared POC ({where}); run `flengine poc prepare -d {folder}` first")
    return poc


def read_kits(poc: PocFolder) -> list[Kit]:
    """The kits of the POC (not verified against their manifests), the server first, then sites and admins."""
    kits = []
    for child in poc.kits.iterdir() if poc.kits.is_dir() else ():
        if (child / KIT_FILE).is_file() and not child.is_symlink():
            kits.append(parse_kit_file(child))
    order = {"server": 0, "site": 1, "admin": 2}
    return sorted(kits, key=lambda kit: (order[kit.participant.kind], natural_key(kit.identity)))


def natural_key(name: str) -> list[Any]:
    """A sort key that puts ``site-2`` before ``site-10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def read_daemons(poc: PocFolder) -> list[Daemon]:
    """Every daemon of the POC, the server first: one per server or site kit, one per pid file without a kit."""
    names = {kit.identity: kit.participant.kind for kit in read_kits(poc) if kit.participant.kind != "admin"}
    records: dict[str, ProcessRecord | None] = {}
    for path in sorted(poc.run.glob("*.pid")) if poc.run.is_dir() else ():
        try:
            record: ProcessRecord | None = read_pid_file(path)
        except (OSError, ValueError):  # unreadable: reported as stale, never signalled
            record = None
        records[path.stem] = record
        if path.stem not in names:
            names[path.stem] = record.kind if record else "site"
    daemons = []
    for name, kind in names.items():
        if name not in records:
            state, pid = "stopped", None
        else:
            record = records[name]
            pid = record.pid if record else None
            state = "running" if record is not None and record.is_running() else "stale"
        daemons.append(Daemon(name, kind, state, pid, poc.log(name)))
    return sorted(daemons, key=lambda d: (d.kind != "server", natural_key(d.name)))


def admin_kit(poc: PocFolder) -> Path | None:
    """The admin kit to talk to the server with: ``kits/admin``, else the first admin kit; None when none."""
    admins = [kit.folder for kit in read_kits(poc) if kit.participant.kind == "admin"]
    preferred = [folder for folder in admins if folder.name == ADMIN_NAME]
    return (preferred or admins or [None])[0]


def server_endpoint(poc: PocFolder) -> str:
    """The server's endpoint from its kit, e.g. ``tcp://127.0.0.1:8002``; empty when there is no server kit."""
    servers = [kit for kit in read_kits(poc) if kit.participant.kind == "server"]
    return servers[0].server.connect_address if servers else ""
