"""The keep-everything aggregators on disk-downloaded results hold one block per client, not n models.

Measured honestly: the process's peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs``) while aggregating 4 results of a 32 MiB tensor read from real files.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.aggregators import CoordinateMedianAggregator, KrumAggregator, TrimmedMeanAggregator
from engine.model import ParamsType

from .test_robust_kept import on_disk, released, result

MIB = 2**20
TENSOR_BYTES = 32 * MIB
COUNT = 4


def status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


def release_free_heap() -> None:
    """Give the pages of freed heap memory back, so that reusing them shows in the resident size.

    Earlier tests in this process leave freed blocks in glibc's heap (below its mmap threshold,
    which the job entry fixes at 4 MiB); a 32 MiB allocation can be served from them without a
    single new resident page, and growth would then read as 0.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing kept that this call could release


def reset_peak() -> None:
    release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")  # resets VmHWM to the current resident size
    except OSError as e:
        pytest.skip(f"cannot reset the peak resident size here: {e}")


def peak_growth(action: Callable[[], Any]) -> tuple[Any, int]:
    """What ``action`` returns, and the bytes by which the peak resident size rose above the size before it."""
    reset_peak()
    before_kib = status_kib("VmRSS")
    returned = action()
    return returned, (status_kib("VmHWM") - before_kib) * 1024


@pytest.mark.parametrize(
    "make",
    [
        CoordinateMedianAggregator,
        lambda **kw: TrimmedMeanAggregator(trim_fraction=0.25, **kw),
        lambda **kw: KrumAggregator(num_byzantine=0, **kw),
    ],
    ids=["median", "trimmed", "krum"],
)
def test_peak_memory_is_the_output_and_a_block_per_client(make, tmp_path: Path) -> None:
    aggregator = make(block_bytes=MIB)
    refs = []
    for i in range(COUNT):
        refs.append(on_disk(tmp_path, {"w": torch.full((TENSOR_BYTES // 4,), float(i))}))
        aggregator.accept_model(result(refs[-1], ParamsType.DIFF), f"site-{i}")
    gc.collect()
    _, control = peak_growth(lambda: torch.ones(TENSOR_BYTES // 4))
    assert control >= TENSOR_BYTES * 0.9  # the meter sees torch's memory

    aggregate, growth = peak_growth(aggregator.aggregate_model)

    assert aggregate.params["w"].nbytes == TENSOR_BYTES
    # The output (32 MiB, or less where the tensor pool reuses last test's) and a few MiB of
    # blocks; resolving the n lazy tensors would add 128 MiB.
    assert growth < TENSOR_BYTES + 12 * MIB, f"peak grew by {growth / MIB:.1f} MiB"
    assert all(released(params) for params in refs)
