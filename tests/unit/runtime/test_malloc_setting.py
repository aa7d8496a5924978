"""glibc's mmap threshold in job processes: above the largest chunk the job streams."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.config import AppConfig, Job
from engine.config.source import ConfigDocument
from engine.runtime.assembly import largest_chunk_bytes
from engine.runtime.process import MMAP_THRESHOLD_BYTES, MMAP_THRESHOLD_MAX_BYTES, mmap_threshold_for

MiB = 1 << 20


def document(**keys: Any) -> ConfigDocument:
    return ConfigDocument(Path("c.conf"), "c.conf", {"format_version": 2, **keys})


def job(*apps: AppConfig) -> Job:
    return Job(Path("job"), document(), {app.name: app for app in apps})


def app(name: str, server: ConfigDocument | None = None, client: ConfigDocument | None = None) -> AppConfig:
    return AppConfig(name, Path(name), None, server=server, client=client)


@pytest.mark.parametrize(
    ("chunk", "threshold"),
    [
        pytest.param(0, MMAP_THRESHOLD_BYTES, id="inline"),
        pytest.param(2 * MiB, 4 * MiB, id="default-2MiB"),
        pytest.param(3 * MiB, 4 * MiB, id="3MiB"),
        pytest.param(8 * MiB, 9 * MiB, id="8MiB"),
        pytest.param(64 * MiB, MMAP_THRESHOLD_MAX_BYTES, id="above-glibc-max"),
    ],
)
def test_the_threshold_lies_above_the_largest_chunk_up_to_glibcs_maximum(chunk: int, threshold: int) -> None:
    assert mmap_threshold_for(chunk) == threshold


def test_the_largest_chunk_of_any_side_and_app_counts() -> None:
    server = document(tensor_download_chunk_size=2 * MiB, np_download_chunk_size=0)
    clients = document(tensor_download_chunk_size=MiB, np_download_chunk_size=8 * MiB)

    assert largest_chunk_bytes(job(app("server-app", server=server), app("client-app", client=clients))) == 8 * MiB


def test_absent_keys_count_as_the_default_chunk_and_all_inline_as_zero() -> None:
    assert largest_chunk_bytes(job(app("a", server=document(), client=document()))) == 2 * MiB
    inline = document(tensor_download_chunk_size=0, np_download_chunk_size=0)
    assert largest_chunk_bytes(job(app("a", server=inline, client=inline))) == 0


# Run in a child process: the setting changes the allocator of the whole process.
_PROBE = """
import ctypes, sys
from engine.runtime.process import return_freed_memory_to_the_system

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
assert return_freed_memory_to_the_system(int(sys.argv[1]))
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)  # an 8 MiB received chunk
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize(("chunk", "own_mappings"), [(2 * MiB, 1), (8 * MiB, 0)])
def test_a_chunk_buffer_comes_from_the_heap_only_below_the_threshold(chunk: int, own_mappings: int) -> None:
    root = str(Path(__file__).resolve().parents[3])
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(chunk)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": root},
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == own_mappings
