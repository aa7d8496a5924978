"""Picking up a re-provisioned server kit while the server runs.

A project admin rolls a new server kit out by replacing the deployed kit folder, or by copying
the new kit over the old one (``docs/security.md``). `KitWatcher` looks at the kit's
``MANIFEST.json``; when it changed, it verifies the kit again and loads what the server takes
from it: the allowlist (exactly the keys the manifest lists, see `engine.provision.Kit`) and the
participants. The server daemon applies the `KitChange` it returns.

A copy takes a moment, so a kit that fails the check is tried again at every look, and the
failure is reported (raised) only once it has stayed for `RELOAD_SETTLE_S` seconds, once per
version of the manifest: a copy in progress is not an error, a copy that went wrong is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from engine.cells.security import Allowlist
from engine.deploy.authz import load_participants
from engine.errors import FlengineError
from engine.provision import MANIFEST_FILE, PARTICIPANTS_FILE, Kit, Participant, load_kit

#: Seconds a changed kit may fail its check (a copy still in progress) before the failure counts.
RELOAD_SETTLE_S = 3.0

Stamp = tuple[int, int, int] | None


@dataclasses.dataclass(frozen=True)
class KitChange:
    """A changed server kit, verified and loaded.

    Attributes:
        kit: The kit as it is now.
        allowlist: The keys its manifest lists.
        participants: Its ``participants.json``.
        added: Identities on the new allowlist that were not on the old one, sorted.
        removed: Identities on the old allowlist that are not on the new one (revoked), sorted.
    """

    kit: Kit
    allowlist: Allowlist
    participants: dict[str, Participant]
    added: list[str]
    removed: list[str]


class KitWatcher:
    """Notices that a server kit's manifest changed and loads the kit again.

    Args:
        kit: The kit the server runs now.
        allowed: The identities on the server's allowlist now.
        settle_s: Seconds a failing kit is tried again before `poll` raises (default
            `RELOAD_SETTLE_S`).
        clock: Monotonic seconds (a test passes its own).

    Example:
        >>> watcher = KitWatcher(kit, allowed=["site-1", "site-2"])
        >>> change = watcher.poll()  # None while the manifest is unchanged
    """

    def __init__(
        self,
        kit: Kit,
        allowed: list[str],
        settle_s: float = RELOAD_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._folder = kit.folder
        self._allowed = sorted(allowed)
        self._settle_s = settle_s
        self._clock = clock
        self._stamp = manifest_stamp(kit.folder)
        self._failing: tuple[Stamp, float] | None = None  # the manifest version that fails, since when
        self._reported = False

    def poll(self) -> KitChange | None:
        """Load the kit again if its manifest changed since the last load.

        Returns:
            The change, or None when the manifest is unchanged or a changed kit does not load
            yet (a copy in progress).

        Raises:
            FlengineError: The changed kit has failed to load for `settle_s` seconds (raised
                once per version of the manifest); the server keeps its old settings.
        """
        stamp = manifest_stamp(self._folder)
        if stamp == self._stamp:
            return None
        try:
            kit = load_kit(self._folder)
            allowlist = kit.load_allowlist()
            participants = load_participants(kit.folder / PARTICIPANTS_FILE)
        except FlengineError:
            now_s = self._clock()
            if self._failing is None or self._failing[0] != stamp:
                self._failing, self._reported = (stamp, now_s), False
            if self._reported or now_s - self._failing[1] < self._settle_s:
                return None
            self._reported = True
            raise
        # The stamp read before loading: a manifest that changed meanwhile is loaded at the next look.
        self._stamp, self._failing = stamp, None
        now = allowlist.identities()
        added, removed = sorted(set(now) - set(self._allowed)), sorted(set(self._allowed) - set(now))
        self._allowed = now
        return KitChange(kit, allowlist, participants, added, removed)


def manifest_stamp(folder: Path) -> Stamp:
    """What tells a changed manifest from the last one: inode, size, mtime (None when missing)."""
    try:
        info = (folder / MANIFEST_FILE).stat()
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns
