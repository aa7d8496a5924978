"""A kit's manifest: the SHA-256 of every file, so a changed kit is refused at start.

``MANIFEST.json`` lists every file of a kit by its path relative to the kit folder, the secret
key included (a swapped secret key is tampering too). Two files are left out: the manifest
itself and ``policy.conf``, the site's own policy, which the site edits. `verify_kit` raises a
`SecurityError` that names every file changed, removed or added since provisioning, except
files added in the folders its caller names as *unlisted_ok*: those it reports and ignores. A
daemon reads only the files the manifest lists, so a file that is not listed changes nothing
(a server kit copied over an older one leaves the keys of revoked participants behind in
``keys/allowlist/``; they are not read).

The manifest is not signed: it catches a kit changed behind its owner's back (a copy gone
wrong, a file swapped by a careless hand or a script), not someone who may write the kit folder
and so could rewrite the manifest too. Keep the kit folder private (mode 0700).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from collections.abc import Collection
from pathlib import Path

from engine.errors import SecurityError

MANIFEST_FILE = "MANIFEST.json"
#: Files of a kit that its owner edits; never hashed.
EDITABLE_FILES = frozenset({"policy.conf"})
_FORMAT_VERSION = 1
_ALGORITHM = "sha256"
_CHUNK_BYTES = 1 << 20
_MAX_MANIFEST_BYTES = 1 << 20
_REFUSED_HINT = "restore the kit from the copy its project admin sent, or ask for a new one (`flengine provision`)"


def kit_digests(folder: Path) -> dict[str, str]:
    """The SHA-256 (hex) of every file of a kit that the manifest covers, by relative POSIX path.

    Raises:
        SecurityError: The kit holds a symlink or something that is not a file or a folder
            (named).
    """
    digests: dict[str, str] = {}
    for path in _walk(folder):
        relative = path.relative_to(folder).as_posix()
        if relative != MANIFEST_FILE and relative not in EDITABLE_FILES:
            digests[relative] = _sha256(path)
    return dict(sorted(digests.items()))


def write_manifest(folder: Path) -> bool:
    """Write ``folder/MANIFEST.json`` for the kit's files as they are now.

    Returns:
        True when the manifest changed (or is new), False when it was already up to date.
    """
    text = json.dumps(
        {"format_version": _FORMAT_VERSION, "algorithm": _ALGORITHM, "files": kit_digests(folder)}, indent=2
    )
    path = folder / MANIFEST_FILE
    if path.is_file() and path.read_text(encoding="utf-8") == text + "\n":
        return False
    temporary = path.with_name(f".{MANIFEST_FILE}.tmp")
    temporary.write_text(text + "\n", encoding="utf-8")
    os.replace(temporary, path)
    return True


@dataclasses.dataclass(frozen=True)
class KitCheck:
    """What `verify_kit` found in a kit that passed.

    Attributes:
        files: Every file the manifest lists (relative POSIX paths), all present and unchanged.
        ignored: Files the manifest does not list, in a folder where that is allowed; never
            read, and reported so that whoever runs the kit can delete them.
    """

    files: tuple[str, ...]
    ignored: tuple[str, ...] = ()


def verify_kit(folder: Path, unlisted_ok: Collection[str] = ()) -> KitCheck:
    """Check that a kit's files are exactly those its manifest lists, unchanged.

    The server and client daemons call this (through `load_kit`) before they read anything
    else of the kit, and read only the files it lists.

    Args:
        folder: The kit folder (holding ``MANIFEST.json``).
        unlisted_ok: Folders of the kit (relative, ending in ``/``, e.g. ``keys/allowlist/``)
            where a file the manifest does not list is ignored and reported instead of refused.
            Empty by default: any added file is refused.

    Returns:
        The files listed, and those ignored.

    Raises:
        SecurityError: No readable manifest, or files changed, removed or added since the kit
            was provisioned; every such file is named, one per line.
    """
    expected = _read_manifest(folder)
    actual = kit_digests(folder)
    problems, ignored = [], []
    for relative in sorted(expected.keys() | actual.keys()):
        if relative not in actual:
            problems.append(f"{folder / relative}: removed since the kit was provisioned")
        elif relative not in expected:
            if any(relative.startswith(place) for place in unlisted_ok):
                ignored.append(relative)
            else:
                problems.append(f"{folder / relative}: added since the kit was provisioned (not in {MANIFEST_FILE})")
        elif actual[relative] != expected[relative]:
            problems.append(f"{folder / relative}: changed since the kit was provisioned ({_ALGORITHM} differs)")
    if problems:
        count = f"{len(problems)} file{'s' if len(problems) != 1 else ''}"
        raise SecurityError("\n".join([f"{folder}: the kit was tampered with ({count}); {_REFUSED_HINT}", *problems]))
    return KitCheck(tuple(sorted(expected)), tuple(ignored))


def _read_manifest(folder: Path) -> dict[str, str]:
    path = folder / MANIFEST_FILE
    try:
        with path.open("rb") as source:
            raw = source.read(_MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise SecurityError(f"{path}: cannot read the kit's manifest: {e.strerror or e}; {_REFUSED_HINT}") from e
    try:
        if len(raw) > _MAX_MANIFEST_BYTES:
            raise ValueError(f"larger than {_MAX_MANIFEST_BYTES} bytes")
        data = json.loads(raw)
        files = data["files"]
        if data.get("algorithm") != _ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"expected {_ALGORITHM} digests")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError("expected file -> digest strings")
    except (ValueError, KeyError, TypeError) as e:
        raise SecurityError(f"{path}: not a valid kit manifest ({e}); {_REFUSED_HINT}") from e
    return files


def _walk(folder: Path) -> list[Path]:
    """Every regular file under ``folder``; a symlink or a special file is refused, never followed."""
    files = []
    for root, folders, names in os.walk(folder, followlinks=False):
        for name in folders + names:
            path = Path(root, name)
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise SecurityError(f"{path}: a kit holds only plain files and folders, not links; {_REFUSED_HINT}")
            if stat.S_ISREG(mode):
                files.append(path)
    return sorted(files)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as source:
            while chunk := source.read(_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as e:
        raise SecurityError(f"{path}: cannot read this file of the kit: {e.strerror or e}") from e
    return digest.hexdigest()
