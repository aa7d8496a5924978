"""`TensorPool`: received and summed tensors reuse the memory of those of the round before.

Every FL round allocates the same tensors again: the model a client downloads, the result the
server pulls, the server's running sum. On Linux glibc serves a block of more than a few MiB
with a fresh ``mmap`` and hands it back to the kernel when freed, so each round faults in the
whole model again, page by page; on the 2-vCPU VM of BENCHMARK.md that costs 0.6-2.5 s per GiB,
while filling memory that is already mapped costs about 0.1 s per GiB.

The pool keeps the storage of every large CPU tensor it hands out. When a new tensor of the same
byte size is asked for and nothing else holds one of those storages any more (its C++ use count
and its Python reference count say so), that storage is reused. A storage nobody has used for
``idle_release_s`` (a job's ``tensor_pool_idle_release_s``, default 10 s) is dropped by a
background sweeper, so memory a job no longer needs goes back to the system. Storages are only
matched by exact size: FL rounds ask for the same sizes again, and a storage that fits nothing
is released rather than kept on the chance of it.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

#: Tensors smaller than this come from ``torch.empty``: glibc already reuses their memory.
DEFAULT_MIN_BYTES = 1 << 20
#: A storage no tensor has used for this long is released.
DEFAULT_IDLE_RELEASE_S = 10.0

_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _Slot:
    """One storage the pool made, and since when nothing but the pool holds it (None: in use)."""

    __slots__ = ("storage", "idle_since")

    def __init__(self, storage: torch.UntypedStorage, idle_since: float | None) -> None:
        self.storage = storage
        self.idle_since = idle_since

    def is_free(self) -> bool:
        # A live tensor on the storage raises the C++ use count; a kept ``untyped_storage()`` of
        # one (the same Python object) raises the reference count above that of a slot alone.
        return _use_count(self.storage._cdata) == 1 and self.references() == _ALONE

    def references(self) -> int:
        """The storage's Python reference count, as counted from here."""
        return sys.getrefcount(self.storage)


def _references_of_a_slot_alone() -> int:
    # Measured rather than assumed: what getrefcount reports differs between Python versions.
    return _Slot(torch.UntypedStorage(0), idle_since=None).references()


_ALONE = _references_of_a_slot_alone()


class TensorPool:
    """Hands out uninitialized CPU tensors, reusing the storage of earlier ones no longer in use.

    Thread-safe. Where this torch build does not expose storage use counts the pool turns itself
    off and `empty` is ``torch.empty``.

    Args:
        min_bytes: Tensors of fewer bytes are not pooled.
        idle_release_s: A free storage not handed out again within this many seconds is released
            (checked every half of it); 0 releases every storage as soon as it is seen free.
    """

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES, idle_release_s: float = DEFAULT_IDLE_RELEASE_S) -> None:
        self.min_bytes = min_bytes
        self.idle_release_s = DEFAULT_IDLE_RELEASE_S
        self.configure(idle_release_s)
        self.enabled = _use_count is not None
        self._slots: dict[int, list[_Slot]] = {}
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()
        self.reused_bytes = 0
        self.allocated_bytes = 0

    def configure(self, idle_release_s: float) -> None:
        """Set how long a free storage is kept (a job's ``tensor_pool_idle_release_s``)."""
        if isinstance(idle_release_s, bool) or not isinstance(idle_release_s, (int, float)) or idle_release_s < 0:
            raise ValueError(f"idle_release_s must be a number of seconds >= 0, got {idle_release_s!r}")
        self.idle_release_s = float(idle_release_s)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``."""
        return self.take(shape, dtype)[0]

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """Like `empty`, and whether the tensor's memory is new (not yet faulted in) or reused."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.enabled or nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype), True
        with self._lock:
            storage = self._take(nbytes)
            fresh = storage is None
            if storage is None:
                storage = torch.UntypedStorage(nbytes)
                self._slots.setdefault(nbytes, []).append(_Slot(storage, idle_since=None))
                self.allocated_bytes += nbytes
                self._start_sweeper()
            else:
                self.reused_bytes += nbytes
            # Made under the lock: from here on the tensor marks the storage as in use.
            return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape)), fresh

    def _take(self, nbytes: int) -> torch.UntypedStorage | None:
        slots = self._slots.get(nbytes, [])
        for slot in list(slots):
            if slot.storage.nbytes() != nbytes:  # resized in place by its user: not ours to reuse
                slots.remove(slot)
            elif slot.is_free():
                slot.idle_since = None
                return slot.storage
        return None

    def stats(self) -> dict[str, float]:
        """The setting and what the pool did so far: bytes allocated fresh and bytes reused."""
        return {
            "idle_release_s": self.idle_release_s,
            "allocated_bytes": self.allocated_bytes,
            "reused_bytes": self.reused_bytes,
        }

    def idle_bytes(self) -> int:
        """Bytes of the storages that nothing but the pool holds now."""
        with self._lock:
            return sum(size for size, slots in self._slots.items() for slot in slots if slot.is_free())

    def release_idle(self, now: float | None = None) -> int:
        """Release the storages free for ``idle_release_s`` or longer; return their bytes.

        A storage seen free for the first time is stamped with ``now`` and released by a later
        call, once it has stayed free long enough.
        """
        now = time.monotonic() if now is None else now
        released = 0
        with self._lock:
            for size, slots in list(self._slots.items()):
                kept = []
                for slot in slots:
                    if not slot.is_free():
                        slot.idle_since = None
                    elif slot.idle_since is None and self.idle_release_s > 0:
                        slot.idle_since = now
                    elif slot.idle_since is None or now - slot.idle_since >= self.idle_release_s:
                        released += size
                        continue
                    kept.append(slot)
                if kept:
                    self._slots[size] = kept
                else:
                    del self._slots[size]
        return released

    def clear(self) -> None:
        """Forget every storage (tensors still in use keep theirs) and stop the sweeper."""
        with self._lock:
            self._slots.clear()
            self._stop.set()
            sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None and sweeper is not threading.current_thread():
            sweeper.join()
        self._stop.clear()

    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, name="flengine-tensor-pool", daemon=True)
            self._sweeper.start()

    def _sweep(self) -> None:
        while not self._stop.wait(max(self.idle_release_s / 2, 0.05)):
            released = self.release_idle()
            if released:
                logger.debug("tensor pool: released %.1f MiB of idle tensor memory", released / 2**20)


#: The process's pool, used where received and aggregated tensors are allocated.
TENSOR_POOL = TensorPool()


def pooled_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, from the process's `TENSOR_POOL`."""
    return TENSOR_POOL.empty(shape, dtype)


def pooled_take(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """`pooled_empty`, and whether the memory is new (see `TensorPool.take`)."""
    return TENSOR_POOL.take(shape, dtype)
