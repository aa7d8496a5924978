"""Getting new tensor memory's pages from the system the way this machine does it best.

A download into new memory (the first one of a process) pays for every page it writes: a fault,
zeroing the page and, in a VM, the host mapping it. `populate_in_background` takes the new
tensors of a download and applies the process's `PageStrategy` (`engine.fobs.page_strategy`,
chosen from the machine's cores, huge page mode and balloon):

- with huge pages, it asks for transparent huge pages over the whole 2 MiB pages of each large
  tensor at once, on the caller's thread (``MADV_HUGEPAGE``: one fault then maps 2 MiB instead
  of 4 KiB);
- with populate threads, daemon threads ask the kernel to map the tensors' pages
  (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14 and later) in the order they will be filled, so
  the faults run beside the transfer on cores it does not use;
- with neither (small pages and no threads, as on one core where the host takes free memory
  back), it does nothing, and each page faults in as the copy first writes it.

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
import time
import weakref
from collections.abc import Callable, Iterable

import torch

from engine.fobs.page_strategy import PageStrategy, page_strategy_here

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
#: Smaller tensors are left alone: glibc serves them from memory it already has, mostly.
MIN_BYTES = 1 << 20
_HUGE_PAGE_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


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


def _huge_page_bytes() -> int | None:
    """The size of a transparent huge page here, or None where the kernel has none."""
    try:
        with open(_HUGE_PAGE_SIZE_FILE) as size_file:
            return int(size_file.read())
    except (OSError, ValueError):
        return None


class PagePopulator:
    """Daemon threads that fault in the pages of the tensors they are given, oldest first.

    `submit` advises huge pages for the tensors at once, on the caller's thread, where the
    strategy takes them; its threads (none where the strategy has none) then take the tensors
    one at a time in the order given, so with two threads the second tensor is faulted in beside
    the first (a VM's host maps memory for each vCPU in parallel: two threads faulted in 1 GiB in
    half the time of one). Thread-safe. Disables itself for good the first time the kernel
    refuses the call (``EINVAL``: a kernel before 5.14).

    Args:
        strategy: Huge pages or not, and how many threads fault memory in; default: the one
            chosen for this machine (`engine.fobs.page_strategy.page_strategy_here`).
    """

    def __init__(self, strategy: PageStrategy | None = None) -> None:
        self.strategy = strategy if strategy is not None else page_strategy_here()
        self._madvise = _load_madvise()
        self.enabled = self._madvise is not None
        self._thread_count = self.strategy.populate_threads
        self._queue: queue.SimpleQueue[weakref.ref[torch.Tensor]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._state = threading.Condition()  # guards the threads, the counts and the figures
        self._pending = 0
        self._huge_page_bytes = _huge_page_bytes() if self.enabled and self.strategy.huge_pages else None
        #: Bytes whose pages this populator asked the kernel to map (a figure for tests and logs).
        self.populated_bytes = 0
        #: Bytes it asked to be mapped with huge pages.
        self.huge_advised_bytes = 0
        #: Seconds its threads spent faulting in, summed over them: what new memory cost here.
        self.populate_seconds = 0.0

    def submit(self, tensors: Iterable[torch.Tensor]) -> None:
        """Prepare the pages of contiguous CPU ``tensors`` (queued to the threads in the order given)."""
        accepted = [t for t in tensors if t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= MIN_BYTES]
        if not accepted or not self.enabled:
            return
        # Before anything is written: pages written already stay small.
        advised = sum(self._advise_huge_pages(t) for t in accepted) if self._huge_page_bytes else 0
        with self._state:
            self.huge_advised_bytes += advised
            if not self._thread_count:  # no threads: pages fault in as the copy first writes them
                return
            self._pending += len(accepted)
            while len(self._threads) < self._thread_count:
                name = f"flengine-page-populator-{len(self._threads) + 1}"
                self._threads.append(threading.Thread(target=self._run, name=name, daemon=True))
                self._threads[-1].start()
        # Weak references: a tensor dropped before its turn (a failed download) is skipped, and
        # the populator never keeps memory alive, nor from being reused, beyond one madvise.
        for tensor in accepted:
            self._queue.put(weakref.ref(tensor))

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Block until everything queued so far was handled (for tests); False on timeout."""
        with self._state:
            return self._state.wait_for(lambda: self._pending == 0, timeout_s)

    def _run(self) -> None:
        while True:
            reference = self._queue.get()
            start, populated = time.perf_counter(), 0
            try:
                tensor = reference() if self.enabled else None
                populated = self._populate(tensor) if tensor is not None else 0
                del tensor
            finally:  # counted as handled whatever happened, so that no one waits for it forever
                with self._state:
                    self.populated_bytes += populated
                    self.populate_seconds += time.perf_counter() - start
                    self._pending -= 1
                    if not self._pending:
                        self._state.notify_all()

    def _advise_huge_pages(self, tensor: torch.Tensor) -> int:
        """Ask for huge pages over the tensor; the bytes advised."""
        # Only the huge pages wholly inside the tensor: the memory around it may be someone else's.
        huge = self._huge_page_bytes
        assert huge and self._madvise is not None
        address = tensor.data_ptr()
        start = -(-address // huge) * huge
        length = (address + tensor.nbytes - start) // huge * huge
        return length if length > 0 and self._madvise(start, length, _MADV_HUGEPAGE) == 0 else 0

    def _populate(self, tensor: torch.Tensor) -> int:
        """Fault in the tensor's pages; the bytes populated."""
        address, nbytes = tensor.data_ptr(), tensor.nbytes
        start = address - address % mmap.PAGESIZE
        assert self._madvise is not None
        if self._madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE) == 0:
            return nbytes
        code = ctypes.get_errno()
        if code == errno.EINVAL:  # the kernel has no MADV_POPULATE_WRITE
            self.enabled = False
            logger.debug("page populator off: this kernel does not support MADV_POPULATE_WRITE")
        else:  # the memory is still there and fine; it will fault in when written
            logger.debug("page populator: madvise failed: %s", errno.errorcode.get(code, code))
        return 0


#: The process's populator, fed by downloads into fresh memory, with this machine's strategy.
PAGE_POPULATOR = PagePopulator()
logger.debug("page strategy: %s (%s)", PAGE_POPULATOR.strategy.name, PAGE_POPULATOR.strategy.reason)


def populate_in_background(tensors: Iterable[torch.Tensor]) -> None:
    """Prepare the new memory of ``tensors`` as this machine's page strategy says (see the module)."""
    PAGE_POPULATOR.submit(tensors)
