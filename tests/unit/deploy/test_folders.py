"""private_folder: a workspace another user made first, or a link, is refused; an existing one of ours is made 0700."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine.deploy.folders import private_folder
from engine.errors import SecurityError


def test_a_new_folder_is_made_0700_and_an_existing_one_of_ours_is_tightened(tmp_path: Path) -> None:
    made = private_folder(tmp_path / "a" / "workspace")
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)

    private_folder(loose)

    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_a_link_or_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("")

    for name in ("link", "file"):
        with pytest.raises(SecurityError, match=f"{name}: not a folder of its own"):
            private_folder(tmp_path / name)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_another_user_made_first_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "server-workspace"
    planted.mkdir()
    os.chown(planted, 4321, -1)

    with pytest.raises(SecurityError, match="owned by user id 4321, not by this user"):
        private_folder(planted)
