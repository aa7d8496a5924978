"""`RssSampler`: a job process records its own memory (resident set size) over time in ``rss.csv``.

Every server and client job process runs one (see ``engine.runtime.entry``): a daemon thread
reads ``/proc/self/statm`` a few times a second (a read of one small file, about 10 µs) and
appends the samples to ``<process workspace>/rss.csv`` in small batches, so a process that is
killed loses at most the last batch. ``flengine report`` draws these files; the summary's peak
RSS still comes from the kernel's high-water mark (``process.json``), which no sampling misses.

The file, one line per sample after a header::

    unix_s,rss_bytes
    1764100000.125,251658240

``unix_s`` is seconds since the epoch (the same clock as the ``at`` of the events, so the
processes of one run line up); ``rss_bytes`` is the resident set size. Its size is bounded:
the sampling interval doubles every `SAMPLES_PER_STEP` samples, and sampling stops after
`MAX_SAMPLES` (about 3 MiB of text). Where there is no ``/proc/self/statm`` (not Linux) nothing
is sampled and no file is written.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: Name of the samples file, in the process's workspace folder.
RSS_FILE = "rss.csv"
RSS_HEADER = "unix_s,rss_bytes"
#: Seconds between samples at the start (4 per second).
DEFAULT_INTERVAL_S = 0.25
#: Seconds between appends to the file (samples wait in memory until then).
DEFAULT_FLUSH_INTERVAL_S = 1.0
#: The interval doubles after each this many samples (an hour at 4 per second).
SAMPLES_PER_STEP = 14_400
#: No sample after this many (at about 30 bytes a line: about 3 MiB).
MAX_SAMPLES = 100_000
_STATM = Path("/proc/self/statm")


def read_rss_bytes() -> int | None:
    """This process's resident set size now, in bytes; None where ``/proc/self/statm`` is missing."""
    try:
        fields = _STATM.read_bytes().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class RssSampler:
    """Samples this process's RSS into ``folder/rss.csv`` from a daemon thread.

    Args:
        folder: The process's workspace folder (it must exist).
        interval_s: Seconds between samples at the start (`DEFAULT_INTERVAL_S`).
        flush_interval_s: Seconds between appends to the file (`DEFAULT_FLUSH_INTERVAL_S`).
        samples_per_step: Samples after which the interval doubles (`SAMPLES_PER_STEP`).
        max_samples: Samples after which sampling stops (`MAX_SAMPLES`).

    Example:
        >>> sampler = RssSampler(Path("workspace/site-1"))
        >>> sampler.start()   # False where there is nothing to sample
        >>> ...
        >>> sampler.stop()    # writes what is left
    """

    def __init__(
        self,
        folder: Path,
        interval_s: float = DEFAULT_INTERVAL_S,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        samples_per_step: int = SAMPLES_PER_STEP,
        max_samples: int = MAX_SAMPLES,
    ) -> None:
        if interval_s <= 0 or flush_interval_s <= 0 or samples_per_step < 1 or max_samples < 1:
            raise ValueError("RssSampler: intervals must be > 0 s and sample counts >= 1")
        self.file = Path(folder) / RSS_FILE
        self.interval_s = interval_s
        self.flush_interval_s = flush_interval_s
        self.samples_per_step = samples_per_step
        self.max_samples = max_samples
        self.samples = 0
        self._pending: list[str] = []
        self._lock = threading.Lock()  # the thread and stop() both write
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Write the header and start sampling; False (and nothing written) where RSS cannot be read."""
        if read_rss_bytes() is None:
            log.debug("no /proc/self/statm: memory is not sampled")
            return False
        try:
            self.file.write_text(RSS_HEADER + "\n", encoding="utf-8")
        except OSError as e:
            log.warning("memory samples not recorded: file=%s error=%s", self.file, e)
            return False
        self._sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop sampling and append what is left, with one last sample (safe to call twice)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=2.0)
            self._sample()
        self.flush()

    def flush(self) -> None:
        """Append the samples taken since the last append."""
        with self._lock:
            lines, self._pending = self._pending, []
            if not lines:
                return
            try:
                with self.file.open("a", encoding="utf-8") as out:
                    out.write("".join(lines))
            except OSError as e:  # a full disk must not end the job
                log.warning("memory samples dropped: file=%s lines=%d error=%s", self.file, len(lines), e)

    def _sample(self) -> None:
        if self.samples >= self.max_samples:
            return
        rss = read_rss_bytes()
        if rss is None:
            return
        with self._lock:
            self._pending.append(f"{time.time():.3f},{rss}\n")
        self.samples += 1
        if self.samples == self.max_samples:
            log.info("memory sampling stopped after %d samples: file=%s", self.samples, self.file)

    def _run(self) -> None:
        last_flush = time.monotonic()
        while not self._stop.wait(self._interval()):
            self._sample()
            if time.monotonic() - last_flush >= self.flush_interval_s:
                self.flush()
                last_flush = time.monotonic()
            if self.samples >= self.max_samples:
                self.flush()
                return

    def _interval(self) -> float:
        return self.interval_s * 2 ** min(self.samples // self.samples_per_step, 16)
