"""Tensors in mappings of their own: given back when freed, and zeros that cost no memory."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from engine.fobs.mapped import mapped_empty, read_only_zeros


def _mapping_of(address: int) -> dict[str, int] | None:
    """The smaps fields (kB) and size (bytes) of the mapping holding ``address``, or None."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(part, 16) for part in first.split("-"))
            if start <= address < end:
                fields = {"size": end - start}
                for field_line in lines[index + 1 : index + 30]:
                    name, _, value = field_line.partition(":")
                    if "-" in name:
                        break
                    if value.strip().endswith("kB"):
                        fields[name] = int(value.split()[0])
                return fields
    return None


def test_a_mapped_tensor_is_unmapped_when_dropped() -> None:
    tensor = mapped_empty(3 << 20)
    tensor.fill_(7)
    address = tensor.data_ptr()
    mapping = _mapping_of(address)

    assert mapping is not None and mapping["Anonymous"] >= 3 << 10 and address % 4096 == 0
    assert int(tensor[123]) == 7 and tensor.dtype is torch.uint8 and tensor.numel() == 3 << 20

    del tensor
    gc.collect()
    assert _mapping_of(address) is None  # given back to the system, not kept in a malloc arena


def _anonymous_kib() -> int:
    """This process's resident anonymous memory (kB): not the kernel's shared zero page."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_read_only_zeros_are_zeros_shared_and_cost_no_anonymous_memory() -> None:
    numel = 64 << 20  # 256 MiB of float32: more than any test asked for, so a new mapping
    values = torch.ones(1 << 20)
    before = _anonymous_kib()
    zeros = read_only_zeros(numel, torch.float32)
    total = sum(float(torch.dot(values, zeros[start : start + values.numel()])) for start in range(0, numel, 1 << 20))
    grown_kib = _anonymous_kib() - before

    assert total == 0.0 and not zeros[-10:].any()
    assert read_only_zeros(10, torch.float64).data_ptr() == zeros.data_ptr()  # one mapping for all
    assert grown_kib < 32 << 10  # every page read, 256 MiB of them, and almost nothing resident
    assert mapped_empty(0).numel() == 0
