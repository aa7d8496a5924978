"""Lazy tensors on disk: what a download to disk hands back instead of tensors.

A disk download leaves one ``.safetensors`` file in a per-transfer temp folder. `TempDirRef`
owns that folder and counts its holders; `LazyTensorDict` maps the stream's keys to the file's
tensors and `LazyRef` stands for one of them (a few hundred bytes, not a tensor) until
``resolve()`` reads it. The folder is deleted when the last holder is released or garbage
collected, or at once by `cleanup_lazy_refs`. Nothing is memory-mapped: ``resolve()`` reads the
tensor's bytes with ``pread`` into a fresh tensor, so a file truncated meanwhile is a clear error
rather than a crash, and no mapping outlives the call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import StreamingError
from engine.fobs.dtypes import torch_dtype
from engine.fobs.tensor_layout import TensorEntry
from engine.fobs.tensor_pool import pooled_empty
from engine.streaming.layout import StreamLayout

log = logging.getLogger(__name__)


class TempDirRef:
    """Ref-counted owner of one temp folder: deleted when its last holder lets go.

    Holders call `hold` once; the returned callable releases that hold (calling it again does
    nothing) and runs by itself when the holder is garbage collected.

    Args:
        path: The folder; it and everything in it are deleted at the end.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._holds = 0
        self._deleted = False

    @property
    def deleted(self) -> bool:
        """Whether the folder is gone (all holders released, or `cleanup` called)."""
        return self._deleted

    @property
    def holds(self) -> int:
        """How many holders have not let go yet."""
        return self._holds

    def hold(self, holder: object) -> weakref.finalize:
        """Count ``holder`` until it is released (call the result) or garbage collected."""
        with self._lock:
            if self._deleted:
                raise StreamingError(f"the downloaded files in {self.path} were already cleaned up")
            self._holds += 1
        return weakref.finalize(holder, self._drop)

    def cleanup(self) -> None:
        """Delete the folder now, whoever still holds it (their reads fail from then on)."""
        with self._lock:
            if self._deleted:
                return
            self._deleted = True
        shutil.rmtree(self.path, ignore_errors=True)
        log.debug("temp folder deleted: path=%s", self.path)

    def _drop(self) -> None:
        with self._lock:
            self._holds -= 1
            last = self._holds == 0
        if last:
            self.cleanup()


class LazyRef:
    """One tensor (or numpy array) of a downloaded file, read only when `resolve` is called.

    It is not a tensor (``isinstance(ref, torch.Tensor)`` is False) but knows the tensor's
    ``shape`` and ``dtype``, so an aggregator can check it before reading it.
    """

    __slots__ = ("file", "name", "shape", "dtype", "offset", "nbytes", "as_numpy", "owner", "_hold", "__weakref__")

    def __init__(self, file: Path, entry: TensorEntry, data_start: int, owner: TempDirRef, as_numpy: bool) -> None:
        self.file = file
        self.name = entry.name
        self.shape = entry.shape
        self.dtype = torch_dtype(entry.dtype)
        self.offset = data_start + entry.begin
        self.nbytes = entry.nbytes
        self.as_numpy = as_numpy
        self.owner = owner
        self._hold = owner.hold(self)

    @property
    def released(self) -> bool:
        """Whether this reference let go of its file."""
        return not self._hold.alive

    def verify(self) -> None:
        """Check that the file still holds this tensor's bytes, without reading them.

        Raises:
            StreamingError: The reference was released, or the file is gone or too short.
        """
        if self.released:
            raise StreamingError(f"lazy tensor {self.name!r} was released; its file may be gone")
        try:
            size = self.file.stat().st_size
        except OSError as e:
            raise StreamingError(f"downloaded file of tensor {self.name!r} is gone: {self.file} ({e.strerror})") from e
        if size < self.offset + self.nbytes:
            raise StreamingError(
                f"downloaded file {self.file} is truncated: {size} bytes, tensor {self.name!r} "
                f"needs bytes up to {self.offset + self.nbytes}"
            )

    def resolve(self) -> torch.Tensor | np.ndarray:
        """Read the tensor from its file into new (pooled) memory and return it (a numpy array for arrays).

        Raises:
            StreamingError: As `verify`, or the read came up short.
        """
        self.verify()
        tensor = pooled_empty(self.shape, self.dtype)
        if self.nbytes:
            _read_exactly(self.file, tensor.reshape(-1).view(torch.uint8).numpy(), self.offset, self.name)
        return tensor.numpy() if self.as_numpy else tensor

    def read_elements(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Read elements ``start .. start + out.numel()`` of the flattened tensor into ``out``.

        ``out`` must be a contiguous tensor of this reference's dtype; it is returned, filled.
        Reading a block at a time lets a caller go over a large tensor (or the same block of
        several clients' tensors) without holding any of them whole.

        Raises:
            StreamingError: As `verify`, or the block lies outside the tensor or the read came up short.
            ValueError: ``out`` has another dtype or is not contiguous.
        """
        if out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.dtype} tensor, got {out.dtype}")
        item = out.element_size()
        first, size = start * item, out.numel() * item
        if start < 0 or first + size > self.nbytes:
            raise StreamingError(f"elements {start}..{start + out.numel()} lie outside tensor {self.name!r}")
        self.verify()
        if size:
            target = out.reshape(-1).view(torch.uint8).numpy()
            _read_exactly(self.file, target, self.offset + first, self.name)
        return out

    def release(self) -> None:
        """Let go of the file (the folder goes when its last holder lets go); safe to repeat."""
        self._hold()

    def __repr__(self) -> str:
        return f"LazyRef(name={self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, file={str(self.file)!r})"


def _read_exactly(path: Path, target: np.ndarray, offset: int, name: str) -> None:
    """Fill ``target`` (bytes) from ``path`` at ``offset``; `StreamingError` if the file ends first."""
    size = target.nbytes
    try:
        with open(path, "rb", buffering=0) as file:
            read = os.preadv(file.fileno(), [target], offset)
            while 0 < read < size:
                more = os.preadv(file.fileno(), [target[read:]], offset + read)
                if more == 0:
                    break
                read += more
    except OSError as e:
        raise StreamingError(f"cannot read tensor {name!r} from {path}: {e.strerror}") from e
    if read != size:
        raise StreamingError(f"downloaded file {path} ended inside tensor {name!r}")


class LazyTensorDict(Mapping[str, torch.Tensor]):
    """The tensors of one downloaded ``.safetensors`` file, by key, read one at a time.

    ``d[key]`` reads that tensor; `make_lazy_ref` gives a `LazyRef` to it instead. The dict
    and every ref share the file's `TempDirRef`.

    Args:
        file: The downloaded file.
        layout: Its layout (keys, dtypes, shapes, offsets), as parsed from its header.
        owner: The temp folder the file is in.
    """

    def __init__(self, file: Path, layout: StreamLayout, owner: TempDirRef) -> None:
        self.file = file
        self.layout = layout
        self.owner = owner
        self._entries = {entry.name: entry for entry in layout.entries}
        self._hold = owner.hold(self)

    def make_lazy_ref(self, key: str, as_numpy: bool = False) -> LazyRef:
        """A `LazyRef` to tensor ``key`` (``as_numpy``: it resolves to a numpy array)."""
        return LazyRef(self.file, self._entry(key), self.layout.data_start, self.owner, as_numpy)

    def __getitem__(self, key: str) -> torch.Tensor:
        ref = self.make_lazy_ref(key)
        try:
            tensor = ref.resolve()
        finally:
            ref.release()
        assert isinstance(tensor, torch.Tensor)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def release(self) -> None:
        """Let go of the file; refs made from this dict keep it until they let go too."""
        self._hold()

    def _entry(self, key: str) -> TensorEntry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{key!r} is not a tensor of {self.file}") from None


def cleanup_lazy_refs(data: Any) -> int:
    """Delete the temp folders of every `LazyRef` and `LazyTensorDict` found in ``data`` now.

    ``data`` may be a ref, a dict, or any nesting of mappings, lists, tuples and dataclasses
    (an FLModel, a DXO, a Shareable). Returns how many folders were deleted.
    """
    owners: dict[int, TempDirRef] = {}
    _collect_owners(data, owners, depth=0)
    deleted = 0
    for owner in owners.values():
        if not owner.deleted:
            owner.cleanup()
            deleted += 1
    return deleted


def _collect_owners(value: Any, owners: dict[int, TempDirRef], depth: int) -> None:
    if depth > 32:
        return
    if isinstance(value, (LazyRef, LazyTensorDict)):
        owners[id(value.owner)] = value.owner
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect_owners(item, owners, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_owners(item, owners, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _collect_owners(getattr(value, field.name), owners, depth + 1)
