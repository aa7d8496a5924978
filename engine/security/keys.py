"""CURVE key files: writing key pairs, loading them safely, and a site's keys folder.

Keys are stored as ZeroMQ certificates (the ZPL text format of czmq and ``zmq.auth``): a public
file ``NAME.key`` and a secret file ``NAME.key_secret`` that also holds the public key. Secret
files are created with mode 0600 and refused at load when the group or others may read them.

A site's *keys folder* holds what its cell needs::

    NAME.key, NAME.key_secret    its own key pair
    server.key                   a client: the public key of the server it connects to
    allowlist/IDENTITY.key       a server: every key it accepts, one file per identity

The identity of an allowlisted key is the file's stem, and must match the ``identity`` in the
file's metadata when it has one, so a renamed file cannot move a key to another identity.
"""

from __future__ import annotations

import datetime
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

import zmq

from engine.cells.fqcn import is_valid_fqcn
from engine.cells.security import Allowlist, CellSecurity, check_key
from engine.errors import SecurityError

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
SERVER_KEY_FILE = "server.key"
ALLOWLIST_FOLDER = "allowlist"
_SECRET_MODE = 0o600
_LINE = re.compile(r'^\s+(identity|public-key|secret-key)\s*=\s*"([^"]*)"\s*$')
_MAX_KEY_FILE_BYTES = 64 << 10


def write_key_pair(folder: Path, name: str) -> tuple[bytes, bytes]:
    """Make a new key pair and write ``folder/NAME.key`` and ``folder/NAME.key_secret`` (mode 0600).

    Args:
        folder: Where the files go (created if missing, mode 0700).
        name: The identity the keys belong to (a cell name such as ``site-1``).

    Returns:
        The public and secret key (Z85).

    Raises:
        SecurityError: A file of that name exists already (keys are never overwritten).
    """
    _check_name(name)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.curve_keypair()
    _write_new(folder / f"{name}{SECRET_SUFFIX}", _certificate(name, public, secret), _SECRET_MODE)
    write_public_key(folder / f"{name}{PUBLIC_SUFFIX}", name, public)
    return public, secret


def write_public_key(path: Path, name: str, public_key: bytes) -> None:
    """Write a public certificate for identity ``name`` (refuses to overwrite)."""
    _check_name(name)
    _write_new(path, _certificate(name, check_key(public_key, str(path)), None), 0o644)


def load_public_key(path: Path) -> tuple[bytes, str | None]:
    """Read a public certificate; return its key and its metadata identity (None if absent).

    Raises:
        SecurityError: Missing, unreadable or malformed file, naming it.
    """
    fields = _read_certificate(path)
    if "public-key" not in fields:
        raise SecurityError(f"{path}: no public-key in this key file; write it with `flengine` or zmq.auth")
    return _key(fields["public-key"], path, "public-key"), fields.get("identity")


def load_secret_key(path: Path) -> tuple[bytes, bytes]:
    """Read a secret certificate; return its public and secret key.

    Raises:
        SecurityError: Missing, unreadable or malformed file, or one the group or others may
            read (named, with the ``chmod`` that fixes it).
    """
    # Opened once, not through a symlink, and checked on the open file: what is checked is
    # what is read.
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise SecurityError(f"{path}: cannot read the secret key file: {e.strerror or e}") from e
    with os.fdopen(descriptor, "rb") as source:
        info = os.fstat(source.fileno())
        mode = info.st_mode
        if not stat.S_ISREG(mode):
            raise SecurityError(f"{path}: the secret key file is not a regular file")
        if info.st_uid != os.getuid():
            raise SecurityError(f"{path}: the secret key file belongs to another user (uid {info.st_uid})")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecurityError(
                f"{path}: the secret key file may be read by others (mode {stat.S_IMODE(mode):04o}); "
                f"run `chmod 600 {path}`"
            )
        fields = _parse_certificate(source.read(_MAX_KEY_FILE_BYTES + 1), path)
    for field in ("public-key", "secret-key"):
        if field not in fields:
            raise SecurityError(f"{path}: no {field} in this secret key file")
    public, secret = _key(fields["public-key"], path, "public-key"), _key(fields["secret-key"], path, "secret-key")
    if zmq.curve_public(secret) != public:
        raise SecurityError(f"{path}: the public key in this file does not belong to its secret key")
    return public, secret


def load_allowlist(folder: Path, identities: Iterable[str] | None = None) -> Allowlist:
    """Read the allowlist of a server's keys folder.

    Args:
        folder: The ``allowlist`` folder (one ``IDENTITY.key`` per peer).
        identities: The identities to read, ``folder/IDENTITY.key`` each, and nothing else
            (a kit passes the files its manifest lists, so a file left behind by a copy is
            never read). None reads every ``*.key`` of the folder (a throw-away keys folder
            of the simulator).

    Raises:
        SecurityError: A missing or empty folder, a missing or malformed file, a file whose
            metadata names another identity, or one key under two identities.
    """
    if not folder.is_dir():
        raise SecurityError(f"{folder}: no allowlist folder; a server needs one file IDENTITY.key per peer it accepts")
    if identities is None:
        paths = sorted(folder.glob(f"*{PUBLIC_SUFFIX}"))
    else:
        paths = [folder / f"{identity}{PUBLIC_SUFFIX}" for identity in sorted(set(identities))]
    keys: dict[str, bytes] = {}
    for path in paths:
        identity = path.name[: -len(PUBLIC_SUFFIX)]
        if not is_valid_fqcn(identity) or "." in identity:
            raise SecurityError(f"{path}: {identity!r} is not a valid identity (a cell name without dots)")
        key, named = load_public_key(path)
        if named is not None and named != identity:
            raise SecurityError(f"{path}: the file is named for {identity!r} but its metadata says {named!r}")
        keys[identity] = key
    if not keys:
        raise SecurityError(f"{folder}: the allowlist is empty; no peer could connect")
    try:
        return Allowlist(keys)
    except ValueError as e:
        raise SecurityError(f"{folder}: {e}") from e


def load_cell_security(keys_dir: Path, name: str, server: bool, allowlist: Iterable[str] | None = None) -> CellSecurity:
    """Load what the cell of site ``name`` needs from its keys folder (see the module docstring).

    Args:
        keys_dir: The site's keys folder.
        name: The site's identity; its key pair is ``NAME.key_secret``.
        server: True for the server cell (loads the allowlist), False for a client (loads
            ``server.key``).
        allowlist: A server: the identities whose ``allowlist/IDENTITY.key`` it reads (see
            `load_allowlist`); None reads every key file there.

    Raises:
        SecurityError: Naming the file that is missing, malformed or unsafe.
    """
    public, secret = load_secret_key(keys_dir / f"{name}{SECRET_SUFFIX}")
    if server:
        return CellSecurity(public, secret, allowlist=load_allowlist(keys_dir / ALLOWLIST_FOLDER, allowlist))
    server_key, _ = load_public_key(keys_dir / SERVER_KEY_FILE)
    return CellSecurity(public, secret, server_public_key=server_key)


def write_site_key_folders(folder: Path, server: str, clients: list[str]) -> dict[str, Path]:
    """Make new key pairs for a server and its clients and write each site's keys folder.

    The server's folder (``folder/SERVER``) holds its key pair and an allowlist of the
    clients; each client's (``folder/CLIENT``) its own key pair and the server's public key.
    The simulator makes such throw-away folders for every run.

    Returns:
        Each site's keys folder, by name.
    """
    server_dir = folder / server
    server_public, _ = write_key_pair(server_dir, server)
    allowlist = server_dir / ALLOWLIST_FOLDER
    allowlist.mkdir(mode=0o700)
    folders = {server: server_dir}
    for site in clients:
        site_dir = folder / site
        public, _ = write_key_pair(site_dir, site)
        write_public_key(site_dir / SERVER_KEY_FILE, server, server_public)
        write_public_key(allowlist / f"{site}{PUBLIC_SUFFIX}", site, public)
        folders[site] = site_dir
    return folders


# --------------------------------------------------------------------------- helpers


def _certificate(name: str, public: bytes, secret: bytes | None) -> str:
    kind = "Public" if secret is None else "**Secret**"
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        f"#   ****  Generated on {stamp} by flengine  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
        "#   " + ("Exchange securely, or use a secure mechanism to verify it after exchange."
                  if secret is None else "DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."),
        "",
        "metadata",
        f'    identity = "{name}"',
        "curve",
        f'    public-key = "{public.decode("ascii")}"',
    ]  # fmt: skip
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return "\n".join(lines) + "\n"


def _write_new(path: Path, text: str, mode: int) -> None:
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as e:
        raise SecurityError(f"{path}: a key file of this name exists already; keys are never overwritten") from e
    with os.fdopen(descriptor, "w", encoding="ascii") as out:
        out.write(text)


def _read_certificate(path: Path) -> dict[str, str]:
    try:
        with path.open("rb") as source:
            raw = source.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise SecurityError(f"{path}: cannot read the key file: {e.strerror or e}") from e
    return _parse_certificate(raw, path)


def _parse_certificate(raw: bytes, path: Path) -> dict[str, str]:
    if len(raw) > _MAX_KEY_FILE_BYTES:
        raise SecurityError(f"{path}: not a key file (larger than {_MAX_KEY_FILE_BYTES} bytes)")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as e:
        raise SecurityError(f"{path}: not a key file (not ASCII text)") from e
    fields: dict[str, str] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            fields[match.group(1)] = match.group(2)
    return fields


def _key(text: str, path: Path, field: str) -> bytes:
    try:
        return check_key(text.encode("ascii"), field)
    except ValueError as e:
        raise SecurityError(f"{path}: {e}") from e


def _check_name(name: str) -> None:
    if not is_valid_fqcn(name) or "." in name:
        raise SecurityError(f"{name!r} is not a valid identity (a cell name without dots, e.g. site-1)")
