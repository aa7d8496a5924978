"""`RssSampler` (a process's memory over time in rss.csv) and the events file of `EventWriter`."""

from __future__ import annotations

import io
import json
import mmap
import os
import time
from pathlib import Path

import pytest

from engine.runtime.process import EventWriter
from engine.runtime.rss import RSS_FILE, RSS_HEADER, RssSampler, read_rss_bytes

linux_only = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="samples need /proc/self/statm")


def vm_rss_bytes() -> int:
    """VmRSS from /proc/self/status: the kernel's own figure, read another way than the sampler's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def samples(folder: Path) -> list[tuple[float, int]]:
    header, *lines = (folder / RSS_FILE).read_text(encoding="utf-8").splitlines()
    assert header == RSS_HEADER
    return [(float(when), int(rss)) for when, rss in (line.split(",") for line in lines)]


@linux_only
def test_read_rss_bytes_agrees_with_the_kernels_vmrss() -> None:
    assert read_rss_bytes() == pytest.approx(vm_rss_bytes(), rel=0.05)


@linux_only
def test_samples_have_increasing_times_and_follow_an_allocation(tmp_path: Path) -> None:
    sampler = RssSampler(tmp_path, interval_s=0.02, flush_interval_s=0.05)
    before = time.time()

    assert sampler.start()
    time.sleep(0.2)
    # 64 MiB of fresh anonymous memory, every page written: RSS grows by it whatever the heap
    # already holds (a malloc'd block may reuse pages an earlier test left resident).
    block = mmap.mmap(-1, 64 << 20)
    block.write(b"\1" * (64 << 20))
    time.sleep(0.2)
    sampler.stop()
    after = time.time()
    block.close()

    taken = samples(tmp_path)
    times = [when for when, _ in taken]
    assert len(taken) >= 10
    assert times == sorted(times) and before - 0.01 <= times[0] and times[-1] <= after + 0.01
    assert all(8 << 20 < rss < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") for _, rss in taken)
    assert max(rss for _, rss in taken) - taken[0][1] >= 60 << 20


@linux_only
def test_the_file_is_bounded_and_the_interval_doubles(tmp_path: Path) -> None:
    sampler = RssSampler(tmp_path, interval_s=0.001, flush_interval_s=0.01, samples_per_step=2, max_samples=5)

    sampler.start()
    time.sleep(0.3)
    sampler.stop()

    assert len(samples(tmp_path)) == 5
    sampler.samples = 4
    assert sampler._interval() == pytest.approx(0.004)
    sampler.samples = 10**9
    assert sampler._interval() == pytest.approx(0.001 * 2**16)  # capped: no overflow


@pytest.mark.parametrize(
    "args",
    [{"interval_s": 0}, {"flush_interval_s": -1}, {"samples_per_step": 0}, {"max_samples": 0}],
    ids=["interval", "flush", "step", "max"],
)
def test_bad_settings_are_refused(tmp_path: Path, args: dict) -> None:
    with pytest.raises(ValueError, match="RssSampler"):
        RssSampler(tmp_path, **args)


def test_events_get_their_time_and_go_to_the_file_too(tmp_path: Path) -> None:
    stream = io.StringIO()
    writer = EventWriter(stream, file=tmp_path / "events.jsonl")
    before = time.time()

    writer("round_started", round=0)
    writer("round_done", round=0, time_s=1.5)
    writer.close()

    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [json.loads(line) for line in stream.getvalue().splitlines()] == lines
    assert [line["event"] for line in lines] == ["round_started", "round_done"]
    assert before - 0.01 <= lines[0]["at"] <= lines[1]["at"] <= time.time() + 0.01
    assert lines[1]["time_s"] == 1.5


def test_a_client_writes_its_events_to_the_file_only_and_the_file_is_bounded(tmp_path: Path) -> None:
    stream = io.StringIO()
    writer = EventWriter(stream, file=tmp_path / "events.jsonl", echo=False, max_file_bytes=300)

    for index in range(20):
        writer("task_done", task="train", index=index)

    assert stream.getvalue() == ""
    kept = (tmp_path / "events.jsonl").read_text()
    assert 0 < len(kept.encode()) <= 300 and kept.endswith("\n")
    assert [json.loads(line)["index"] for line in kept.splitlines()] == list(range(len(kept.splitlines())))
