"""`provision`: write a project's startup kits into a folder, or bring existing ones up to date.

The output folder is the project admin's record: one kit per participant, and the server kit's
``keys/allowlist/`` holds the public key of every site and admin. Running again with the same
folder therefore never makes a key twice:

- a new participant gets a new kit and key pair, and its key joins the server's allowlist;
- an existing kit keeps its key files byte for byte; its ``kit.json``, ``start.sh`` (and the
  server's ``participants.json``) are rewritten when the project file changed them (a new host
  or port, a new org or role), and its manifest with them;
- a participant no longer in the project file is refused unless ``remove`` is set: then its
  key leaves the server's allowlist and ``participants.json``, and its kit folder is deleted
  (the key is revoked; adding the name back later makes a new key);
- a kit whose keys do not match the server's allowlist, a kit changed by hand (its manifest
  says so), a missing kit whose key is still on the allowlist, or a participant that changed
  kind stops the run with the folder and the fix.

Everything is checked before anything is written: an error leaves the folder as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from engine.errors import ProvisionError, SecurityError
from engine.provision.kit import (
    KEYS_FOLDER,
    KIT_FILE,
    PARTICIPANTS_FILE,
    START_SCRIPT,
    Kit,
    kit_file_text,
    parse_kit_file,
    participants_file_text,
    start_script_text,
)
from engine.provision.manifest import MANIFEST_FILE, verify_kit, write_manifest
from engine.provision.policy import POLICY_FILE, default_policy_text
from engine.provision.project import Participant, Project
from engine.security import (
    ALLOWLIST_FOLDER,
    SERVER_KEY_FILE,
    load_public_key,
    load_secret_key,
    write_key_pair,
    write_public_key,
)

Status = Literal["created", "updated", "kept", "removed"]
_PRIVATE = 0o700
_SCRIPT_MODE = 0o755


@dataclasses.dataclass(frozen=True)
class KitReport:
    """What provisioning did to one participant's kit.

    Attributes:
        identity: The participant.
        kind: ``server``, ``site`` or ``admin`` (``unknown`` for a removed one of unknown kind).
        status: ``created``, ``updated`` (``files`` lists what was written), ``kept`` or ``removed``.
        folder: The kit folder.
        files: The kit's files written by this run, relative to ``folder`` (empty when kept).
    """

    identity: str
    kind: str
    status: Status
    folder: Path
    files: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ProvisionReport:
    """What `provision` wrote: one entry per kit, the server first.

    Attributes:
        project: The project's name.
        output: The output folder.
        kits: One report per participant, and one per removed participant.
    """

    project: str
    output: Path
    kits: tuple[KitReport, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (``flengine provision --format json``)."""
        kits = [{**dataclasses.asdict(kit), "folder": str(kit.folder), "files": list(kit.files)} for kit in self.kits]
        return {"project": self.project, "output": str(self.output), "kits": kits}

    def table(self) -> list[str]:
        """The kits as text, under a header: status, name, kind, folder (and what an update wrote).

        ``flengine provision`` and ``flengine poc prepare`` print this same table.
        """
        width = max([4, *(len(kit.identity) for kit in self.kits)])
        lines = [f"{'status':<8} {'name':<{width}}  {'kind':<6}  folder"]
        for kit in self.kits:
            what = "key revoked, kit deleted" if kit.status == "removed" else str(kit.folder)
            changed = f": {', '.join(kit.files)}" if kit.status == "updated" else ""
            lines.append(f"{kit.status:<8} {kit.identity:<{width}}  {kit.kind:<6}  {what}{changed}")
        return lines


@dataclasses.dataclass
class _Existing:
    """What an output folder already holds, checked for consistency."""

    kits: dict[str, Kit] = dataclasses.field(default_factory=dict)
    allowlist: dict[str, bytes] = dataclasses.field(default_factory=dict)
    server_public: bytes | None = None
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)  # from participants.json


def provision(project: Project, output: Path, *, remove: bool = False) -> ProvisionReport:
    """Write (or update) one startup kit per participant of ``project`` under ``output/<name>/``.

    Args:
        project: A checked project (see `load_project`).
        output: The output folder; created (mode 0700) when missing.
        remove: Revoke participants that the folder holds but the project no longer names.

    Returns:
        What was created, updated, kept or removed, per kit.

    Raises:
        ProvisionError: The folder holds another project, a server of another name, a kit
            that is missing or not a kit, a participant that changed kind, or (without
            ``remove``) participants the project file no longer names. Nothing is written.
        SecurityError: A kit was changed by hand, or its keys do not match the server's
            allowlist or key. Nothing is written.
    """
    existing = _survey(project, output)
    removed = _check_removals(project, output, existing, remove)
    if not output.exists():
        output.mkdir(parents=True, mode=_PRIVATE)
    written: dict[str, list[str]] = {name: [] for name in project.names}
    _write_keys(project, output, existing, written)
    _revoke(removed, output / project.server.name, output, written[project.server.name])
    reports = []
    for participant in project.participants:
        folder = output / participant.name
        files = written[participant.name]
        _write_settings(project, participant, folder, files)
        if write_manifest(folder):
            files.append(MANIFEST_FILE)
        status: Status = "created" if participant.name not in existing.kits else "updated" if files else "kept"
        reports.append(KitReport(participant.name, participant.kind, status, folder, tuple(files)))
    for name in removed:
        reports.append(KitReport(name, existing.kinds.get(name, "unknown"), "removed", output / name))
    return ProvisionReport(project.name, output, tuple(reports))


# --------------------------------------------------------------------------- reading what is there


def _survey(project: Project, output: Path) -> _Existing:
    """Read the kits already in ``output`` and check that they agree with each other and the project."""
    existing = _Existing()
    if not output.exists():
        return existing
    if not output.is_dir():
        raise ProvisionError(f"{output}: not a folder; give -o a new folder, or the one the kits were written to")
    names = set(project.names)
    for child in sorted(output.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_symlink() or not (child / KIT_FILE).is_file():
            if child.name in names:
                raise ProvisionError(f"{child}: not a kit (no {KIT_FILE}); move it away, or give -o another folder")
            continue
        kit = parse_kit_file(child)
        if kit.identity != child.name:
            raise ProvisionError(
                f"{child}: holds the kit of {kit.identity!r}; rename the folder back to {kit.identity}"
            )
        if kit.project != project.name:
            raise ProvisionError(
                f"{output}: holds the kits of project {kit.project!r}, not {project.name!r}; give -o another folder"
            )
        verify_kit(child)
        existing.kits[kit.identity] = kit
    if existing.kits:
        _check_server(project, output, existing)
        _check_clients(project, output, existing)
    return existing


def _check_server(project: Project, output: Path, existing: _Existing) -> None:
    servers = [kit for kit in existing.kits.values() if kit.participant.kind == "server"]
    if not servers:
        raise ProvisionError(
            f"{output}: holds kits but no server kit; restore {output / project.server.name} (the kits there trust "
            "its key), or give -o a new folder"
        )
    if len(servers) > 1 or servers[0].identity != project.server.name:
        found = ", ".join(repr(kit.identity) for kit in servers)
        raise ProvisionError(
            f"{output}: the server is {found} there but {project.server.name!r} in the project file; a server of "
            "another name needs new kits for everyone: give -o a new folder"
        )
    server = servers[0]
    existing.server_public, _ = load_secret_key(server.keys_dir / f"{server.identity}.key_secret")
    for path in sorted((server.keys_dir / ALLOWLIST_FOLDER).glob("*.key")):
        existing.allowlist[path.stem] = load_public_key(path)[0]
    existing.kinds = _read_kinds(server.folder / PARTICIPANTS_FILE)
    existing.kinds.update({name: kit.participant.kind for name, kit in existing.kits.items()})


def _check_clients(project: Project, output: Path, existing: _Existing) -> None:
    allowlist_dir = output / project.server.name / KEYS_FOLDER / ALLOWLIST_FOLDER
    for name, kit in existing.kits.items():
        if kit.participant.kind == "server":
            continue
        secret_file = kit.keys_dir / f"{name}.key_secret"
        public, _ = load_secret_key(secret_file)
        listed = existing.allowlist.get(name)
        if listed is None:
            raise SecurityError(
                f"{kit.folder}: the key of {name!r} is not on the server's allowlist ({allowlist_dir}); a kit left by "
                f"an interrupted run or brought from elsewhere: delete the folder to make a new kit for {name!r}"
            )
        if listed != public or load_public_key(kit.keys_dir / f"{name}.key")[0] != public:
            raise SecurityError(
                f"{secret_file}: does not match the key of {name!r} on the server's allowlist "
                f"({allowlist_dir / f'{name}.key'}); restore both from the copies that were sent out, or delete "
                f"{kit.folder} and the allowlist file to make a new key (the deployed kit then stops working)"
            )
        if load_public_key(kit.keys_dir / SERVER_KEY_FILE)[0] != existing.server_public:
            raise SecurityError(
                f"{kit.keys_dir / SERVER_KEY_FILE}: is not the public key of the server kit "
                f"({output / project.server.name}); this kit trusts another server: delete {kit.folder} to make "
                f"a new kit for {name!r}"
            )
    for name in sorted(existing.allowlist.keys() - existing.kits.keys()):
        if name in project.names:
            raise ProvisionError(
                f"{output / name}: missing, but the server's allowlist holds the key of {name!r}; restore the kit "
                "folder (a new key would lock the deployed kit out), or revoke it first: drop it from the project "
                "file, run with --remove, then add it back"
            )
    for name, kit in existing.kits.items():
        if name in project.names and project.participant(name).kind != kit.participant.kind:
            raise ProvisionError(
                f"{kit.folder}: {name!r} was provisioned as {_a(kit.participant.kind)} and is "
                f"{_a(project.participant(name).kind)} in the project file; give it another name, or revoke it first "
                "(drop it from the project file, run with --remove) and add it back"
            )


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def _read_kinds(path: Path) -> dict[str, str]:
    """Identity -> kind from a server's ``participants.json`` (empty when there is none to read)."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["participants"]
        return {name: str(entry["kind"]) for name, entry in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _check_removals(project: Project, output: Path, existing: _Existing, remove: bool) -> list[str]:
    removed = sorted((existing.kits.keys() | existing.allowlist.keys()) - set(project.names))
    if removed and not remove:
        listed = ", ".join(repr(name) for name in removed)
        one = len(removed) == 1
        raise ProvisionError(
            f"{output}: {listed} {'has a kit' if one else 'have kits'} there but the project file no longer names "
            f"{'it' if one else 'them'}; run again with --remove to revoke {'its key' if one else 'their keys'} "
            "(off the server's allowlist, kit folder deleted), or put it back in the project file"
        )
    return removed


# --------------------------------------------------------------------------- writing


def _write_keys(project: Project, output: Path, existing: _Existing, written: dict[str, list[str]]) -> None:
    """Make key pairs for new participants; a new site's or admin's key joins the server's allowlist."""
    server = project.server.name
    keys = output / server / KEYS_FOLDER
    server_public = existing.server_public
    if server not in existing.kits:
        _make_private_folder(output / server)
        server_public, _ = write_key_pair(keys, server)
        written[server] += [f"{KEYS_FOLDER}/{server}.key", f"{KEYS_FOLDER}/{server}.key_secret"]
    assert server_public is not None
    (keys / ALLOWLIST_FOLDER).mkdir(mode=_PRIVATE, exist_ok=True)
    for participant in project.participants:
        name = participant.name
        if participant.kind == "server" or name in existing.kits:
            continue
        folder = output / name
        _make_private_folder(folder)
        public, _ = write_key_pair(folder / KEYS_FOLDER, name)
        write_public_key(folder / KEYS_FOLDER / SERVER_KEY_FILE, server, server_public)
        written[name] += [
            f"{KEYS_FOLDER}/{name}.key",
            f"{KEYS_FOLDER}/{name}.key_secret",
            f"{KEYS_FOLDER}/{SERVER_KEY_FILE}",
        ]
        write_public_key(keys / ALLOWLIST_FOLDER / f"{name}.key", name, public)
        written[server].append(f"{KEYS_FOLDER}/{ALLOWLIST_FOLDER}/{name}.key")


def _revoke(removed: list[str], server_dir: Path, output: Path, server_files: list[str]) -> None:
    """Take removed participants off the server's allowlist and delete their kits."""
    for name in removed:
        entry = server_dir / KEYS_FOLDER / ALLOWLIST_FOLDER / f"{name}.key"
        if entry.exists():
            entry.unlink()
            server_files.append(f"{KEYS_FOLDER}/{ALLOWLIST_FOLDER}/{name}.key")
        if (output / name / KIT_FILE).is_file():
            shutil.rmtree(output / name)


def _write_settings(project: Project, participant: Participant, folder: Path, files: list[str]) -> None:
    """Write the kit's settings files that differ from what the project says now."""
    _write_if_changed(folder, KIT_FILE, kit_file_text(project, participant), 0o644, files)
    _write_if_changed(folder, START_SCRIPT, start_script_text(project, participant), _SCRIPT_MODE, files)
    if participant.kind == "server":
        _write_if_changed(folder, PARTICIPANTS_FILE, participants_file_text(project), 0o644, files)
    if participant.kind == "site" and not (folder / POLICY_FILE).exists():
        # the site's own file: written once, never overwritten
        _write_if_changed(folder, POLICY_FILE, default_policy_text(participant.name, project.name), 0o644, files)


def _write_if_changed(folder: Path, relative: str, text: str, mode: int, files: list[str]) -> None:
    path = folder / relative
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        os.chmod(path, mode)
        return
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.chmod(temporary, mode)
    os.replace(temporary, path)
    files.append(relative)


def _make_private_folder(folder: Path) -> None:
    folder.mkdir(mode=_PRIVATE)
