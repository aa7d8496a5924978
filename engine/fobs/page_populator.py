"""Faulting in fresh tensor memory on a background thread, ahead of the thread that fills it.

A download into new memory (the first one of a process) pays a page fault for every 4 KiB it
writes, on the thread that places the chunks; on a 2-vCPU VM that was most of a cold 1 GiB
transfer, while the other core waited. `populate_in_background` hands the tensors to one
daemon thread that asks the kernel to map their pages (``madvise(MADV_POPULATE_WRITE)``, Linux
5.14 and later) in the order they will be filled, so the faults run beside the transfer.

It never writes the memory: a page already written by the filling thread is left as it is, and
a tensor nothing else holds any more (its download failed before its turn) is skipped. Where
the kernel lacks the call, or off Linux, it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterable

import torch

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
#: Smaller tensors are left alone: glibc serves them from memory it already has, mostly.
MIN_BYTES = 1 << 20


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


class PagePopulator:
    """One daemon thread that faults in the pages of the tensors it is given, oldest first.

    Thread-safe. Disables itself for good the first time the kernel refuses the call
    (``EINVAL``: a kernel before 5.14).
    """

    def __init__(self) -> None:
        self._madvise = _load_madvise()
        self.enabled = self._madvise is not None
        self._queue: queue.SimpleQueue[list[weakref.ref[torch.Tensor] | _Marker]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Bytes whose pages this populator asked the kernel to map (a figure for tests and logs).
        self.populated_bytes = 0

    def submit(self, tensors: Iterable[torch.Tensor]) -> None:
        """Queue contiguous CPU ``tensors`` to be faulted in, in the order given."""
        # Weak references: a tensor dropped before its turn (a failed download) is skipped, and
        # the populator never keeps memory alive, nor from being reused, beyond one madvise.
        batch: list[weakref.ref[torch.Tensor] | _Marker] = [
            weakref.ref(t) for t in tensors if t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= MIN_BYTES
        ]
        if not batch or not self.enabled:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flengine-page-populator", daemon=True)
                self._thread.start()
        self._queue.put(batch)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Block until everything queued so far was handled (for tests); False on timeout."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._queue.put([_Marker(done)])
        return done.wait(timeout_s)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            for item in batch:
                if isinstance(item, _Marker):
                    item.done.set()
                    continue
                tensor = item() if self.enabled else None
                if tensor is not None:
                    self._populate(tensor)
                del tensor

    def _populate(self, tensor: torch.Tensor) -> None:
        address, nbytes = tensor.data_ptr(), tensor.nbytes
        start = address - address % mmap.PAGESIZE
        assert self._madvise is not None
        if self._madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE) == 0:
            self.populated_bytes += nbytes
            return
        code = ctypes.get_errno()
        if code == errno.EINVAL:  # the kernel has no MADV_POPULATE_WRITE
            self.enabled = False
            logger.debug("page populator off: this kernel does not support MADV_POPULATE_WRITE")
        else:  # the memory is still there and fine; it will fault in when written
            logger.debug("page populator: madvise failed: %s", errno.errorcode.get(code, code))


class _Marker:
    """Queued by `PagePopulator.wait_idle`: set once everything before it was handled."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done


#: The process's populator, fed by downloads into fresh memory.
PAGE_POPULATOR = PagePopulator()


def populate_in_background(tensors: Iterable[torch.Tensor]) -> None:
    """Fault in the memory of ``tensors`` on the process's populator thread, in order."""
    PAGE_POPULATOR.submit(tensors)
