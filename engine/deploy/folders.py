"""`private_folder`: a daemon's workspace (and POC's folders) belong to the user who runs it, and to nobody else.

A workspace holds the job store, the audit log and every site's results; POC's ``run/`` holds the
pid files ``poc stop`` signals. A folder that another local user created first (``/tmp/...``, a
shared disk) would let them plant a job, read results or point ``stop`` at a process of theirs,
so an existing folder is used only when it is a real folder (not a link) owned by this user,
and is made 0700.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import SecurityError


def private_folder(path: Path) -> Path:
    """Create ``path`` (0700, parents as needed) or check an existing one; return it.

    Raises:
        SecurityError: ``path`` is a link or not a folder, or another user owns it; the
            message names it and the fix.
    """
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:  # a file of that name: refused just below
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise SecurityError(f"{path}: not a folder of its own (a link or a file); give another folder")
    if info.st_uid != os.getuid():
        raise SecurityError(
            f"{path}: owned by user id {info.st_uid}, not by this user ({os.getuid()}); "
            "another user could plant or read files there: give a folder of your own"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path
