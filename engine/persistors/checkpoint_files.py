"""Checkpoint files written atomically: a temp file beside the target, fsync, then rename over it.

`write_safetensors_atomic` does it all before returning. `CheckpointCommits` splits the work:
the caller writes the temp file (with direct I/O where the filesystem has it, see
`engine.persistors.safetensors_writer`) and the rest, fsync and rename, runs in a background
thread while the caller goes on.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.persistors.safetensors_writer import write_safetensors

#: Temp files are named ``.<target name>.<random>.tmp`` in the target's folder.
TEMP_SUFFIX = ".tmp"


def write_safetensors_temp(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    """Write ``tensors`` as safetensors to a new temp file beside ``path``; return the temp file.

    Nothing is fsynced or renamed yet. On failure the temp file is removed.
    """
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    os.close(fd)
    try:
        write_safetensors(tensors, Path(temp_name))
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return Path(temp_name)


def write_safetensors_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` to ``path`` as safetensors: temp file in the same folder, fsync, rename.

    On any failure the temp file is removed and ``path`` is left as it was.
    """
    commit_files([(write_safetensors_temp(tensors, path), path)])


def commit_files(moves: Sequence[tuple[Path, Path]]) -> None:
    """Make each ``(temp, target)`` durable: fsync every temp file, rename it over its target, fsync the folders.

    On failure every temp file not renamed yet is removed and its target left as it was.
    """
    done = 0
    try:
        for temp, _ in moves:
            fsync_file(temp)
        for temp, target in moves:
            os.replace(temp, target)
            done += 1
    except BaseException:
        for temp, _ in moves[done:]:
            temp.unlink(missing_ok=True)
        raise
    for folder in {target.parent for _, target in moves}:
        fsync_folder(folder)


def remove_stale_temp_files(folder: Path, names: Sequence[str]) -> list[Path]:
    """Delete the temp files a crashed process left for the files ``names`` in ``folder``; return them."""
    if not folder.is_dir():
        return []
    stale = [path for name in names for path in folder.glob(f".{name}.*{TEMP_SUFFIX}") if path.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


class CheckpointCommits:
    """Commits (fsync + rename) checkpoint files in a background thread, one commit at a time, in order.

    A new commit waits for the one before it, so files are never renamed out of order. A failed
    commit is raised by the next call to `commit` or `wait`.

    Example:
        >>> commits = CheckpointCommits()
        >>> commits.commit([(write_safetensors_temp(tensors, path), path)])
        >>> ...  # the next round runs meanwhile
        >>> commits.wait()  # path holds the new file, on disk
    """

    def __init__(self) -> None:
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None

    def commit(self, moves: Sequence[tuple[Path, Path]]) -> None:
        """Start committing ``moves`` (see `commit_files`) once the previous commit is done.

        Raises:
            OSError: The previous commit failed (its temp files are gone, its targets unchanged).
        """
        self.wait()
        thread = threading.Thread(target=self._run, args=(list(moves),), name="checkpoint-commit", daemon=True)
        self._pending = thread
        thread.start()

    def wait(self) -> None:
        """Return once no commit is running.

        Raises:
            OSError: The last commit failed; the error names the file.
        """
        thread, self._pending = self._pending, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self, moves: list[tuple[Path, Path]]) -> None:
        try:
            commit_files(moves)
        except OSError as e:
            targets = ", ".join(str(target) for _, target in moves)
            reason = f"checkpoint {targets} was not saved: {e.strerror or e}"
            self._error = OSError(e.errno, reason) if e.errno is not None else OSError(reason)
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self._error = e


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(directory: Path) -> None:
    """Flush ``directory``'s entries to disk (a rename in it is durable then)."""
    # Makes the rename itself durable on POSIX; not possible (nor needed) on Windows.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
