"""Downloads to disk: each received tensor stream becomes one file, handed back as lazy refs.

`DiskTensorConsumer` writes a stream into ``tensors.safetensors`` in a temp folder of its own
and returns a `LazyTensorDict` over it. `DiskDownloads` is the folder a process downloads into:
``<root>/run-<pid>-<token>/``, one per run, deleted when the run closes it; opening one sweeps
the run folders of processes that are no longer alive (a crashed server's leftovers).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

from engine.errors import StreamingError
from engine.streaming.consumers import DiskConsumer
from engine.streaming.layout import StreamLayout
from engine.streaming.lazy import LazyTensorDict, TempDirRef

log = logging.getLogger(__name__)

#: The file a disk download writes in its temp folder.
TENSORS_FILE = "tensors.safetensors"
_RUN_FOLDER = re.compile(r"^run-(\d+)-[0-9a-f]+$")


class DiskTensorConsumer(DiskConsumer):
    """Writes one tensor stream into a new temp folder under ``root``; returns lazy refs to it.

    Nothing is deserialized: the stream's bytes land in the file as they come (space for all of
    them reserved first, so a full disk fails at once, naming the folder and the bytes). On
    failure the folder and what was written are removed.

    Args:
        layout: The stream's layout (parsed from its header).
        chunk_bytes: The chunk size, in bytes.
        root: The folder the per-transfer temp folder is made in.
    """

    def __init__(self, layout: StreamLayout, chunk_bytes: int, root: Path) -> None:
        try:
            folder = Path(tempfile.mkdtemp(prefix="xfer-", dir=root))
        except OSError as e:
            raise StreamingError(f"cannot make a temp folder in {root} for a download: {e.strerror}") from e
        self.owner = TempDirRef(folder)
        try:
            super().__init__(layout, chunk_bytes, folder / TENSORS_FILE)
        except BaseException:
            self.owner.cleanup()
            raise

    def finish(self) -> LazyTensorDict:  # type: ignore[override]
        return LazyTensorDict(super().finish(), self.layout, self.owner)

    def abort(self) -> None:
        super().abort()
        self.owner.cleanup()


class DiskConsumerFactory:
    r"""Makes `DiskTensorConsumer`\ s in one run's folder and counts them (a `ConsumerFactory`)."""

    def __init__(self, downloads: DiskDownloads, folder: Path) -> None:
        self._downloads = downloads
        self.folder = folder

    def __call__(self, layout: StreamLayout, chunk_bytes: int) -> DiskTensorConsumer:
        consumer = DiskTensorConsumer(layout, chunk_bytes, self.folder)
        self._downloads.downloads += 1
        return consumer


class DiskDownloads:
    """One run's download folder, ``<root>/run-<pid>-<token>/``, and how many downloads it took.

    Args:
        root: Where run folders live (made if missing). Several processes may share it: each
            sweeps only folders whose process is gone.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.folder: Path | None = None
        self.downloads = 0

    def open(self) -> Path:
        """Sweep dead runs' folders, make this run's folder and return it.

        Raises:
            StreamingError: The root cannot be made or written.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            swept = sweep_dead_runs(self.root)
            self.folder = self.root / f"run-{os.getpid()}-{secrets.token_hex(4)}"
            self.folder.mkdir()
        except OSError as e:
            raise StreamingError(f"download_to_disk_dir {self.root}: cannot make a download folder: {e}") from e
        if swept:
            log.warning("leftover downloads of crashed runs deleted: root=%s folders=%d", self.root, len(swept))
        log.info("downloads go to disk: folder=%s", self.folder)
        return self.folder

    def consumer_factory(self) -> DiskConsumerFactory:
        """Makes the consumers of this run's downloads (for a `StreamingContext`); counts them."""
        if self.folder is None:
            raise StreamingError("the download folder is not open")
        return DiskConsumerFactory(self, self.folder)

    def bytes_used(self) -> int:
        """Bytes of files under this run's folder now."""
        return folder_bytes(self.folder) if self.folder is not None else 0

    def close(self) -> None:
        """Delete this run's folder and whatever is left in it."""
        if self.folder is not None:
            left = folder_bytes(self.folder)
            if left:
                log.warning("downloads left at the end deleted: folder=%s bytes=%d", self.folder, left)
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def sweep_dead_runs(root: Path) -> list[Path]:
    """Delete the run folders under ``root`` whose process is not alive; return them."""
    swept = []
    for entry in root.iterdir():
        match = _RUN_FOLDER.match(entry.name)
        if match and entry.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            swept.append(entry)
    return swept


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 if it is gone)."""
    total = 0
    for path, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(path, name)).st_size
            except OSError:  # deleted meanwhile
                pass
    return total


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
