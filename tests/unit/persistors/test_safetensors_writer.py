"""write_safetensors: safetensors files, written past the page cache where the filesystem allows."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from engine.fobs.dtypes import is_supported
from engine.persistors.safetensors_writer import STAGING_BYTES, write_safetensors

FALLBACK_MESSAGE = "no direct I/O"


def all_dtypes() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "weight": torch.randn(33, 17, generator=generator),
        "mask": torch.tensor([True, False, True]),
        "steps": torch.arange(5, dtype=torch.int64),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "odd": torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=generator),
    }
    for dtype in (torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32, torch.complex64):
        tensors[str(dtype)] = torch.randn(11, generator=generator).to(dtype)
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        dtype = getattr(torch, name, None)
        if dtype is not None and is_supported(dtype):
            tensors[name] = torch.arange(9).to(dtype)
    return tensors


def supports_direct_io(folder: Path) -> bool:
    probe = folder / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def assert_holds(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``path`` is a safetensors file of exactly ``tensors``, bit for bit, and nothing more."""
    loaded = safetensors.torch.load(path.read_bytes())  # refuses trailing or missing bytes
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert loaded[name].view(-1).view(torch.uint8).tolist() == tensor.view(-1).view(torch.uint8).tolist(), name


@pytest.mark.parametrize("direct", [True, False])
def test_every_dtype_reads_back_bitwise_equal(tmp_path: Path, direct: bool) -> None:
    tensors = all_dtypes()
    path = tmp_path / "model.safetensors"

    write_safetensors(tensors, path, direct=direct)

    assert_holds(path, tensors)


def test_direct_io_is_used_where_the_filesystem_has_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if not supports_direct_io(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} has no O_DIRECT")
    # Larger than the staging buffer and not a multiple of the block size: several whole
    # blocks, then a padded last one that the file is cut back from.
    tensors = {"big": torch.arange(STAGING_BYTES // 4 * 2 + 1001, dtype=torch.float32), "small": torch.ones(3)}
    path = tmp_path / "model.safetensors"

    with caplog.at_level(logging.DEBUG, logger="engine.persistors.safetensors_writer"):
        write_safetensors(tensors, path)

    assert FALLBACK_MESSAGE not in caplog.text
    assert_holds(path, tensors)


def test_a_full_disk_raises(small_disk: Path) -> None:
    with pytest.raises(OSError, match="No space left on device"):
        write_safetensors({"big": torch.ones(1 << 19)}, small_disk / "model.safetensors")  # 2 MiB on 1 MiB


def test_tensors_that_are_not_contiguous_cpu_tensors_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'t'.*contiguous CPU tensor"):
        write_safetensors({"t": torch.ones(4, 4).t()}, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()
