"""A startup kit: the folder one participant gets, and reading it back at start.

::

    site-1/
      kit.json            project, identity, kind, org, the server's address, resources / role
      keys/               site-1.key, site-1.key_secret (0600), server.key
      start.sh            runs `flengine client start <this folder>`
      policy.conf         the site's own policy (sites only; not in the manifest)
      MANIFEST.json       sha256 of every other file
    server/
      kit.json  keys/ (server.key, server.key_secret, allowlist/IDENTITY.key)  participants.json ...

A daemon reads only what the kit's manifest lists: the server's allowlist is the
``keys/allowlist/IDENTITY.key`` files of its manifest, and any other file there (the key of a
participant revoked since, left behind when a new kit was copied over the old one) is ignored
and reported in `Kit.ignored_files`.

``kit.json`` is JSON, not HOCON: flengine writes it and reads it, nobody edits it (it is in the
manifest), so it needs no comments, includes or substitutions, and the same bytes come out of
the same project every time. The site's ``policy.conf`` is HOCON because people edit it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from engine.cells import CellSettings
from engine.cells.security import Allowlist, CellSecurity
from engine.errors import ProvisionError
from engine.provision.manifest import KitCheck, verify_kit
from engine.provision.project import ROLES, Participant, Project, ServerAddress
from engine.security import ALLOWLIST_FOLDER, PUBLIC_SUFFIX, load_allowlist, load_cell_security

KIT_FILE = "kit.json"
KEYS_FOLDER = "keys"
START_SCRIPT = "start.sh"
PARTICIPANTS_FILE = "participants.json"
#: Where a server kit keeps its allowlist; a file there that the manifest does not list is ignored.
ALLOWLIST_PATH = f"{KEYS_FOLDER}/{ALLOWLIST_FOLDER}/"
KIT_FORMAT_VERSION = 1
#: Largest message a daemon's or admin session's cell takes (job processes keep their job's limit).
DAEMON_MAX_MESSAGE_BYTES = 16 << 20
_MAX_KIT_FILE_BYTES = 1 << 20

#: The command each kind of participant starts, after ``flengine``; the kit folder follows.
START_COMMANDS = {"server": "server start", "site": "client start", "admin": "admin"}
_START_USAGE = {
    "server": "./start.sh [--workspace DIR]   (runs until stopped)",
    "site": "./start.sh [--workspace DIR]   (runs until stopped)",
    "admin": "./start.sh COMMAND [ARGS]      (e.g. ./start.sh list)",
}
_START_SCRIPT = """\
#!/bin/sh
# Starts {identity} ({kind}) of project {project} from this kit.
# Written by `flengine provision`; MANIFEST.json covers this file.
# Usage: {usage}
# Set FLENGINE to the flengine command to use (default: the one on PATH).
set -eu
KIT=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd -P)
exec "${{FLENGINE:-flengine}}" {command} "$KIT" "$@"
"""


@dataclasses.dataclass(frozen=True)
class Kit:
    """A verified startup kit, as a daemon or the admin command sees it.

    Attributes:
        folder: The kit folder.
        project: The project's name.
        participant: Whose kit it is: identity, kind, org, role, resources.
        server: The server's address (what a client connects to, what the server binds).
        allowlist: A server kit: the identities whose ``keys/allowlist/IDENTITY.key`` its
            manifest lists, and so the only ones its cell accepts. Empty for other kits, and
            for a kit read without its manifest (`parse_kit_file`).
        ignored_files: Files of the kit that its manifest does not list, in a folder where that
            is allowed (``keys/allowlist/``); never read. Whoever runs the kit may delete them.
    """

    folder: Path
    project: str
    participant: Participant
    server: ServerAddress
    allowlist: tuple[str, ...] = ()
    ignored_files: tuple[str, ...] = ()

    @property
    def identity(self) -> str:
        """The kit owner's identity (its cell name)."""
        return self.participant.name

    @property
    def keys_dir(self) -> Path:
        """The kit's keys folder, as `engine.security.load_cell_security` reads it."""
        return self.folder / KEYS_FOLDER

    def cell_settings(self) -> CellSettings:
        """The daemon's or admin session's cell: the server binds ``bind_host:port``; a client's
        address comes from ``server``. Their messages are commands, status and 1 MiB chunks of
        job archives, so a message over `DAEMON_MAX_MESSAGE_BYTES` is refused on receipt."""
        if self.participant.kind == "server":
            return CellSettings(
                host=self.server.bind_host, port=self.server.port, max_message_size_bytes=DAEMON_MAX_MESSAGE_BYTES
            )
        return CellSettings(max_message_size_bytes=DAEMON_MAX_MESSAGE_BYTES)

    def cell_security(self) -> CellSecurity:
        """Load the CURVE keys of the kit owner's cell (for the server, the allowlist its manifest lists)."""
        server = self.participant.kind == "server"
        return load_cell_security(self.keys_dir, self.identity, server=server, allowlist=self.allowlist)

    def load_allowlist(self) -> Allowlist:
        """Load the server's allowlist: exactly the keys its manifest lists (see `allowlist`).

        Raises:
            SecurityError: A listed key file is missing or malformed (named), or the kit lists
                none (a kit that is not a server's, or one read without its manifest).
        """
        return load_allowlist(self.keys_dir / ALLOWLIST_FOLDER, self.allowlist)


def load_kit(folder: str | os.PathLike[str]) -> Kit:
    """Verify a kit against its manifest and read its ``kit.json``.

    Raises:
        SecurityError: The kit was changed since it was provisioned (see `verify_kit`).
        ProvisionError: ``kit.json`` is not one `flengine provision` writes.
    """
    folder = Path(folder)
    check = verify_kit(folder, unlisted_ok=(ALLOWLIST_PATH,))
    return parse_kit_file(folder, check)


def parse_kit_file(folder: Path, check: KitCheck | None = None) -> Kit:
    """Read ``folder/kit.json``; without ``check`` (what `verify_kit` found) the manifest is not read.

    Provisioning reads its own kits without their manifests; a kit read so has no `Kit.allowlist`.
    """
    path = folder / KIT_FILE
    try:
        with path.open("rb") as source:
            data = json.loads(source.read(_MAX_KIT_FILE_BYTES))
        if data["format_version"] != KIT_FORMAT_VERSION:
            raise ValueError(f"format_version {data['format_version']!r}, this flengine reads {KIT_FORMAT_VERSION}")
        kind, role = data["kind"], data.get("role")
        if kind not in START_COMMANDS or (kind == "admin") != (role in ROLES):
            raise ValueError(f"kind {kind!r} with role {role!r}")
        server = data["server"]
        address = ServerAddress(server["name"], server["host"], int(server["port"]), server.get("bind_host", ""))
        participant = Participant(data["identity"], kind, data["org"], role, dict(data.get("resources", {})))
    except OSError as e:
        raise ProvisionError(f"{path}: cannot read the kit file: {e.strerror or e}") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ProvisionError(f"{path}: not a kit file of this flengine ({e}); provision the kit again") from e
    if check is None:
        return Kit(folder, data["project"], participant, address)
    allowlist = tuple(
        name[len(ALLOWLIST_PATH) : -len(PUBLIC_SUFFIX)]
        for name in check.files
        if name.startswith(ALLOWLIST_PATH) and name.endswith(PUBLIC_SUFFIX) and "/" not in name[len(ALLOWLIST_PATH) :]
    )
    return Kit(folder, data["project"], participant, address, allowlist, check.ignored)


def kit_file_text(project: Project, participant: Participant) -> str:
    """The ``kit.json`` of one participant (the same bytes for the same project, every time)."""
    server = project.server
    data: dict[str, Any] = {
        "format_version": KIT_FORMAT_VERSION,
        "project": project.name,
        "identity": participant.name,
        "kind": participant.kind,
        "org": participant.org,
    }
    if participant.role is not None:
        data["role"] = participant.role
    if participant.kind == "site":
        data["resources"] = dict(participant.resources)
    data["server"] = {"name": server.name, "host": server.host, "port": server.port}
    if participant.kind == "server":
        data["server"]["bind_host"] = server.bind_host
    return json.dumps(data, indent=2) + "\n"


def participants_file_text(project: Project) -> str:
    """The server's ``participants.json``: identity -> kind, org, role, resources of everyone."""
    everyone = {participant.name: participant.describe() for participant in project.participants}
    return json.dumps({"project": project.name, "participants": everyone}, indent=2) + "\n"


def start_script_text(project: Project, participant: Participant) -> str:
    """The kit's ``start.sh``: runs the participant's flengine command on the kit's own folder."""
    return _START_SCRIPT.format(
        identity=participant.name,
        kind=participant.kind,
        project=project.name,
        usage=_START_USAGE[participant.kind],
        command=START_COMMANDS[participant.kind],
    )
