"""The page populator maps new tensor memory in the background and never changes what it holds."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from engine.fobs import page_populator
from engine.fobs.mapped import mapped_empty
from engine.fobs.page_populator import MIN_BYTES, PagePopulator
from engine.fobs.page_strategy import OVERRIDE_ENV, PageStrategy, choose_page_strategy, machine_facts
from engine.fobs.tensor_pool import TENSOR_POOL
from engine.streaming.consumers import MemoryConsumer
from engine.streaming.layout import StreamLayout

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
LIBC = ctypes.CDLL(None, use_errno=True)


def resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the tensor's pages that are in memory (``mincore``), whatever other threads do."""
    start = tensor.data_ptr() - tensor.data_ptr() % PAGE
    pages = -(-(tensor.data_ptr() + tensor.nbytes - start) // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    if LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in vector) / pages


def huge_page_mib(tensor: torch.Tensor) -> float:
    """The memory of the mappings that hold ``tensor`` mapped with transparent huge pages."""
    begin, end, total_kib, inside = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line: its address range
                low, high = (int(bound, 16) for bound in line.split(" ", 1)[0].split("-"))
                inside = low < end and high > begin
            elif inside and line.startswith("AnonHugePages:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


def populator_thread_count() -> int:
    return sum(thread.name.startswith("flengine-page-populator") for thread in threading.enumerate())


def transparent_huge_pages_on() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


HUGE_IN_BACKGROUND = PageStrategy(huge_pages=True, populate_threads=2)


@pytest.fixture
def populator() -> PagePopulator:
    """A populator that takes huge pages and faults in on two threads, whatever this machine chose."""
    populator = PagePopulator(HUGE_IN_BACKGROUND)
    if not populator.enabled:
        pytest.skip("no madvise(MADV_POPULATE_WRITE) here (Linux 5.14 and later)")
    return populator


def test_new_memory_becomes_resident_without_being_written(populator: PagePopulator) -> None:
    tensor = mapped_empty(64 * MIB)  # a mapping of its own: untouched pages, whatever the heap holds
    assert resident_fraction(tensor) < 0.1

    populator.submit([tensor])
    assert populator.wait_idle()

    assert populator.populated_bytes == tensor.nbytes
    assert resident_fraction(tensor) == 1.0
    assert populator.populate_seconds > 0


def test_what_the_filling_thread_writes_meanwhile_is_kept(populator: PagePopulator) -> None:
    tensor = torch.empty(96 * MIB, dtype=torch.uint8)
    pattern = torch.arange(MIB, dtype=torch.int64).remainder(251).to(torch.uint8)
    tensor[: 32 * MIB].copy_(pattern.repeat(32))  # written before

    populator.submit([tensor])
    writer = threading.Thread(target=lambda: tensor[32 * MIB :].copy_(pattern.repeat(64)))  # and while
    writer.start()
    writer.join()
    assert populator.wait_idle()

    assert torch.equal(tensor, pattern.repeat(96))


def test_large_new_memory_is_mapped_with_huge_pages(populator: PagePopulator) -> None:
    if not transparent_huge_pages_on():
        pytest.skip("transparent huge pages are off here")
    huge = 2 * MIB
    tensor = torch.empty(64 * MIB, dtype=torch.uint8)
    assert huge_page_mib(tensor) <= 2  # nothing written yet (but glibc's header, if huge pages are always on)

    populator.submit([tensor])
    assert populator.wait_idle()

    # Whole huge pages inside the tensor only: at most one lost at each end.
    assert populator.huge_advised_bytes % huge == 0
    assert tensor.nbytes - 2 * huge <= populator.huge_advised_bytes <= tensor.nbytes
    assert huge_page_mib(tensor) >= 32  # the kernel may refuse a few; most are huge


def test_two_threads_fault_in_a_whole_model(populator: PagePopulator) -> None:
    two = PagePopulator(PageStrategy(huge_pages=False, populate_threads=2))
    layers = [torch.empty(16 * MIB, dtype=torch.uint8) for _ in range(8)]
    threads_before = populator_thread_count()

    two.submit(layers)
    assert two.wait_idle()

    assert two.populated_bytes == 8 * 16 * MIB
    assert all(resident_fraction(layer) == 1.0 for layer in layers)
    assert populator_thread_count() - threads_before == 2


def test_small_non_contiguous_and_dropped_tensors_are_left_alone(populator: PagePopulator) -> None:
    small = torch.empty(MIN_BYTES // 2, dtype=torch.uint8)
    strided = torch.empty(8 * MIB, dtype=torch.uint8)[::2]

    populator.submit([small, strided])
    populator.submit(torch.empty(8 * MIB, dtype=torch.uint8) for _ in range(1))  # gone before its turn
    assert populator.wait_idle()

    assert populator.populated_bytes == 0


def test_without_threads_new_memory_faults_in_only_as_it_is_written() -> None:
    inline = PagePopulator(PageStrategy(huge_pages=False, populate_threads=0))
    tensor = mapped_empty(64 * MIB)  # untouched pages, whatever the heap holds
    threads_before = populator_thread_count()

    inline.submit([tensor])
    assert inline.wait_idle()

    assert (inline.populated_bytes, inline.huge_advised_bytes) == (0, 0)
    assert populator_thread_count() == threads_before
    assert resident_fraction(tensor) < 0.1  # nothing mapped it ahead of the writer
    tensor[: 16 * MIB].fill_(7)
    assert 0.24 <= resident_fraction(tensor) < 0.35  # what was written, and only that


def test_huge_pages_without_threads_are_advised_but_not_populated() -> None:
    if not transparent_huge_pages_on():
        pytest.skip("transparent huge pages are off here")
    advising = PagePopulator(PageStrategy(huge_pages=True, populate_threads=0))
    tensor = mapped_empty(64 * MIB)  # untouched pages, whatever the heap holds

    advising.submit([tensor])
    assert advising.wait_idle()

    assert advising.populated_bytes == 0
    assert tensor.nbytes - 4 * MIB <= advising.huge_advised_bytes <= tensor.nbytes
    assert resident_fraction(tensor) < 0.1
    tensor.fill_(1)
    assert huge_page_mib(tensor) >= 32  # written: mapped with huge pages, as advised


def test_a_download_into_new_memory_is_populated_and_one_into_reused_memory_is_not(
    populator: PagePopulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(page_populator, "PAGE_POPULATOR", populator)  # as a machine that populates
    tensors = {"weight": torch.randn(1024, 1024), "bias": torch.randn(16)}
    layout = StreamLayout.of_tensors(tensors)
    TENSOR_POOL.clear()  # no memory of earlier tests to reuse

    first = MemoryConsumer(StreamLayout.parse(layout.header), MIB)
    assert populator.wait_idle()
    populated = populator.populated_bytes
    first.abort()
    del first
    again = MemoryConsumer(StreamLayout.parse(layout.header), MIB)  # the weight's memory, reused
    assert populator.wait_idle()

    assert populated == 4 * MIB  # the weight; the 64-byte bias is too small to matter
    assert populator.populated_bytes == populated
    again.abort()


def test_the_process_populator_takes_the_strategy_chosen_for_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)

    assert PagePopulator().strategy == choose_page_strategy(machine_facts())
