"""Where a server optimizer keeps its state (FedOpt's momentum ``m`` and second moment ``v``).

Both stores hand out the state one block of one tensor at a time: `MemoryState` as views of
tensors it holds, `FileState` read from (and written back to) one file per slot in a folder of
the server's workspace, so that Adam's two extra model copies cost disk and page cache, not the
server's memory. Every value starts at 0.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

#: Prefix of the folder a `FileState` makes in the workspace (``fedopt_state-<hex>``).
STATE_FOLDER_PREFIX = "fedopt_state-"


class OptimizerState(Protocol):
    """Blocks of the state tensors, by slot (``"m"``, ``"v"``) and param name."""

    def block(self, slot: str, name: str, numel: int, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
        """Elements ``start .. start + count`` of the flat state ``slot`` of ``name`` (``numel`` elements of ``dtype``).

        Change it in place, then hand it to `commit`. The block is valid until the next call.
        """

    def commit(self, slot: str, name: str, start: int, block: torch.Tensor) -> None:
        """Keep the changed ``block`` (from `block`) as the state's new values."""

    def close(self) -> None:
        """Forget the state (a file store deletes its folder)."""

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor, flat, as ``"<slot>/<param name>"`` (for a checkpoint; valid until the next change)."""

    def import_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back what `export_tensors` gave (a resumed run, before its first step)."""


def _split_key(key: str) -> tuple[str, str]:
    slot, sep, name = key.partition("/")
    if not sep or not slot or not name:
        raise ValueError(f"optimizer state {key!r}: expected '<slot>/<param name>'")
    return slot, name


class MemoryState:
    """The state as tensors in memory, one flat tensor per slot and name (zeros when first asked for)."""

    def __init__(self) -> None:
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}

    def block(self, slot: str, name: str, numel: int, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
        tensor = self._tensors.get((slot, name))
        if tensor is None:
            tensor = self._tensors[(slot, name)] = torch.zeros(numel, dtype=dtype)
        _check_fits(name, tensor.numel(), tensor.dtype, numel, dtype)
        return tensor[start : start + count]

    def commit(self, slot: str, name: str, start: int, block: torch.Tensor) -> None:
        """Nothing to do: the block is a view of the state."""

    def close(self) -> None:
        self._tensors.clear()

    def export_tensors(self) -> dict[str, torch.Tensor]:
        return {f"{slot}/{name}": tensor for (slot, name), tensor in self._tensors.items()}

    def import_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            self._tensors[_split_key(key)] = tensor.flatten().clone()


class FileState:
    """The state in files, one per slot, in a new folder under ``parent`` (deleted by `close`).

    Each param gets a byte range of each file when first asked for (the file is extended, so the
    range reads as zeros); blocks are read with ``preadv`` into one buffer per slot and written
    back with ``pwritev``: the server's memory holds a block per slot, whatever the model's size.

    Args:
        parent: The folder to make the state's folder in (the server's workspace).
        block_elements: The most elements a block may have (the buffers' size).

    Raises:
        OSError: The folder or its files cannot be made.
    """

    def __init__(self, parent: Path, block_elements: int) -> None:
        self.folder = Path(parent) / f"{STATE_FOLDER_PREFIX}{secrets.token_hex(6)}"
        self.folder.mkdir(parents=True)
        self._block_elements = block_elements
        self._files: dict[str, int] = {}  # slot -> file descriptor
        self._ends: dict[str, int] = {}  # slot -> bytes of its file so far
        self._ranges: dict[tuple[str, str], tuple[int, int, torch.dtype]] = {}  # offset, numel, dtype
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        log.info("server optimizer state on disk: folder=%s", self.folder)

    @property
    def bytes_used(self) -> int:
        """Bytes of state in the files."""
        return sum(self._ends.values())

    def block(self, slot: str, name: str, numel: int, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
        offset = self._range(slot, name, numel, dtype)
        if start < 0 or count < 0 or start + count > numel or count > self._block_elements:
            raise ValueError(f"state block {start}..{start + count} of {name!r} lies outside it or is too large")
        buffer = self._buffers.get((slot, dtype))
        if buffer is None:
            buffer = self._buffers[(slot, dtype)] = torch.empty(self._block_elements, dtype=dtype)
        out = buffer[:count]
        _pread_full(self._files[slot], out, offset + start * out.element_size(), self.folder / slot)
        return out

    def commit(self, slot: str, name: str, start: int, block: torch.Tensor) -> None:
        offset, _, _ = self._ranges[(slot, name)]
        data = block.contiguous().view(torch.uint8).numpy()
        position, written = offset + start * block.element_size(), 0
        while written < data.size:
            written += os.pwritev(self._files[slot], [data[written:]], position + written)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The state as views of its files mapped in memory (page cache, not the server's own memory)."""
        mapped = {
            slot: torch.from_file(str(self.folder / slot), shared=True, size=end, dtype=torch.uint8)
            for slot, end in self._ends.items()
            if end
        }
        out = {}
        for (slot, name), (offset, numel, dtype) in self._ranges.items():
            size = numel * torch.empty(0, dtype=dtype).element_size()
            out[f"{slot}/{name}"] = mapped[slot][offset : offset + size].view(dtype)
        return out

    def import_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write each tensor into its slot's file, a block at a time."""
        for key, tensor in tensors.items():
            slot, name = _split_key(key)
            flat = tensor.flatten()
            for start in range(0, flat.numel(), self._block_elements):
                count = min(self._block_elements, flat.numel() - start)
                block = self.block(slot, name, flat.numel(), flat.dtype, start, count)
                block.copy_(flat[start : start + count])
                self.commit(slot, name, start, block)

    def _range(self, slot: str, name: str, numel: int, dtype: torch.dtype) -> int:
        """The byte offset of ``name``'s state in ``slot``'s file (given one now if it has none)."""
        known = self._ranges.get((slot, name))
        if known is not None:
            _check_fits(name, known[1], known[2], numel, dtype)
            return known[0]
        if slot not in self._files:
            self._files[slot] = os.open(self.folder / slot, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._ends[slot] = 0
        offset = self._ends[slot]
        self._ends[slot] = offset + numel * torch.empty(0, dtype=dtype).element_size()
        os.ftruncate(self._files[slot], self._ends[slot])  # a hole: reads as zeros, costs no disk yet
        self._ranges[(slot, name)] = (offset, numel, dtype)
        return offset

    def close(self) -> None:
        """Close the files and delete the folder (the state is not kept for a later run)."""
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()
        self._buffers.clear()
        shutil.rmtree(self.folder, ignore_errors=True)
        log.info("server optimizer state deleted: folder=%s", self.folder)


def _check_fits(name: str, numel: int, dtype: torch.dtype, want_numel: int, want_dtype: torch.dtype) -> None:
    if numel != want_numel or dtype != want_dtype:
        raise ValueError(
            f"param {name!r} now has {want_numel} elements of {want_dtype}, its optimizer state {numel} of {dtype}"
        )


def _pread_full(descriptor: int, out: torch.Tensor, position: int, path: Path) -> None:
    """Fill ``out`` with the file's bytes at ``position``."""
    target = out.view(torch.uint8).numpy()
    read = 0
    while read < target.size:
        count = os.preadv(descriptor, [target[read:]], position + read)
        if count == 0:
            raise OSError(f"optimizer state file {path} ended early")
        read += count
