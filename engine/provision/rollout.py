"""The shell commands that roll a re-provisioned server kit out to where the server runs it.

``flengine provision PROJECT -o DIR --server-kit DEST`` prints them after its report. They
*replace* the deployed kit folder rather than copy the new kit over it: the new kit is copied
next to it (``DEST.new``), swapped in with two renames, and the old one deleted, so no file of
the old kit stays behind and the running server never reads a half-copied kit for long (it
checks the kit against its manifest before it loads anything, and tries again until the copy is
whole). ``DEST`` is a folder on this machine, or ``HOST:PATH`` on another one (then ``scp`` and
``ssh`` do the same there). Copying the new kit over the old one works too (files the new
manifest does not list are ignored); ``docs/security.md`` has both ways.

Example:
    >>> for line in rollout_commands("kits/server", "/srv/flengine/server", first=False):
    ...     print(line)
    rm -rf /srv/flengine/server.new && cp -Rp kits/server /srv/flengine/server.new
    mv /srv/flengine/server /srv/flengine/server.old && mv /srv/flengine/server.new /srv/flengine/server
    rm -rf /srv/flengine/server.old
"""

from __future__ import annotations

import shlex
from pathlib import Path

from engine.errors import UsageError


def rollout_commands(source: str | Path, destination: str, *, first: bool) -> list[str]:
    """The commands that put the server kit ``source`` in place of the one at ``destination``.

    Args:
        source: The server kit `provision` wrote (``kits/server``).
        destination: Where the server runs its kit: a folder, or ``HOST:PATH`` on another
            machine (``scp`` and ``ssh`` reach it).
        first: True when nothing is deployed there yet (the server kit was just created):
            the kit is copied in place, nothing is swapped.

    Returns:
        One shell command per line, to run in the folder where ``source`` is relative to.

    Raises:
        UsageError: ``destination`` is empty, or ends in ``/`` or ``.`` (name the kit folder
            itself, e.g. ``/srv/flengine/server``).
    """
    host, path = _split(destination)
    if not path or path.endswith(("/", "/.")) or path in (".", ".."):
        raise UsageError(
            f"--server-kit {destination!r}: name the folder the server runs its kit from, e.g. /srv/flengine/server"
        )
    new, old, kit = shlex.quote(f"{path}.new"), shlex.quote(f"{path}.old"), shlex.quote(path)
    swap = f"mv {new} {kit}" if first else f"mv {kit} {old} && mv {new} {kit}"
    if host is None:
        commands = [f"rm -rf {new} && cp -Rp {shlex.quote(str(source))} {new}", swap]
        return commands if first else [*commands, f"rm -rf {old}"]
    remote = shlex.quote(host)
    commands = [
        f"ssh {remote} {shlex.quote(f'rm -rf {new}')}",
        f"scp -rp {shlex.quote(str(source))} {shlex.quote(f'{host}:{path}.new')}",
        f"ssh {remote} {shlex.quote(swap if first else f'{swap} && rm -rf {old}')}",
    ]
    return commands


def _split(destination: str) -> tuple[str | None, str]:
    """``HOST:PATH`` -> (HOST, PATH); a local path (no ``:`` before its first ``/``) -> (None, path)."""
    head, colon, tail = destination.partition(":")
    if colon and head and "/" not in head:
        return head, tail
    return None, destination
