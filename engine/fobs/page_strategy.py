"""How new tensor memory gets its pages on this machine: huge or small, in the background or inline.

A download into memory a process has not had before pays for every page it writes: the kernel's
fault, zeroing the page and, in a VM, the host mapping the guest's memory. Which way is cheapest
depends on the machine, so `choose_page_strategy` decides from what it has:

- Huge pages (``MADV_HUGEPAGE``): one fault maps 2 MiB instead of 4 KiB. Taken where the kernel
  has transparent huge pages for advised memory (``madvise``; with ``always`` it maps them
  without advice) and does not report free memory to a hypervisor. A VM whose balloon has free
  page reporting (``VIRTIO_BALLOON_F_REPORTING``) hands free blocks of 2 MiB and up back to its
  host, so a huge page is memory the host must map again, page by page, while small pages
  come first from the smaller free blocks it still backs: on the 2-vCPU VM of BENCHMARK.md,
  1 GiB faulted in with huge pages took 1.0-2.2 s and with small pages 0.46-0.48 s, each in a
  fresh process (docs/performance.md).
- Background threads (``MADV_POPULATE_WRITE``) fault the tensors in ahead of the thread that
  fills them, which then copies into mapped memory; asking the kernel for a whole tensor also
  costs less CPU than a fault per page (placing a cold 1 GiB took 0.46-0.48 s of CPU with one
  such thread, 0.57-0.70 s with the faults inline). They take at most all cores but one, so that the receiving
  loop keeps a core: two threads (a VM's host maps memory for each vCPU in parallel), one on a
  2-core machine, none on one core (pages then fault in as the copy first writes them). On
  the 2-vCPU VM, a cold 1 GiB moved at a median 0.65 GiB/s with one thread and small pages,
  0.46 with none, 0.32 with huge pages and two threads (docs/performance.md).

``FLENGINE_PAGE_STRATEGY`` overrides the choice (for measurements): ``huge`` or ``small``, then
``:`` and the number of background threads, e.g. ``small:0`` or ``huge:2``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: Background threads at most (a VM's host maps memory for two vCPUs in parallel).
BACKGROUND_THREADS = 2
#: The environment variable that overrides the choice.
OVERRIDE_ENV = "FLENGINE_PAGE_STRATEGY"

_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_BALLOONS = Path("/sys/bus/virtio/drivers/virtio_balloon")
_VIRTIO_BALLOON_F_REPORTING = 5


@dataclass(frozen=True)
class MachineFacts:
    """What the page strategy is chosen from.

    Attributes:
        cores: CPUs this process may run on.
        huge_pages: The kernel's transparent huge page mode: ``always``, ``madvise``, ``never``,
            or ``none`` where it has none.
        free_page_reporting: Whether a virtio balloon reports free memory to the host.
    """

    cores: int
    huge_pages: str
    free_page_reporting: bool


@dataclass(frozen=True)
class PageStrategy:
    """How new tensor memory is faulted in.

    Attributes:
        huge_pages: Advise transparent huge pages over each new tensor before it is written.
        populate_threads: Threads that fault new tensors in ahead of the copy (0: inline, as
            the copy first writes each page).
        reason: Why, in words (for logs and benchmark output).
    """

    huge_pages: bool
    populate_threads: int
    reason: str = ""

    @property
    def name(self) -> str:
        """``huge:2``, ``small:0``: the form ``FLENGINE_PAGE_STRATEGY`` takes."""
        return f"{'huge' if self.huge_pages else 'small'}:{self.populate_threads}"


def choose_page_strategy(facts: MachineFacts) -> PageStrategy:
    """The page strategy for a machine with ``facts`` (see the module's docstring)."""
    threads = max(0, min(BACKGROUND_THREADS, facts.cores - 1))  # one core stays with the receiving loop
    where = f"{facts.cores} usable cores"
    if facts.huge_pages not in ("always", "madvise"):
        return PageStrategy(False, threads, f"{where}, no transparent huge pages")
    if facts.free_page_reporting:
        return PageStrategy(False, threads, f"{where}, a balloon reports free 2 MiB blocks to the host")
    return PageStrategy(True, threads, f"{where}, transparent huge pages ({facts.huge_pages})")


def parse_override(text: str) -> PageStrategy:
    """A strategy from ``FLENGINE_PAGE_STRATEGY`` text (``huge:2``, ``small:0``).

    Raises:
        ValueError: The text is not of that form.
    """
    kind, _, threads = text.strip().partition(":")
    if kind not in ("huge", "small") or not threads.isdigit() or int(threads) > 16:
        raise ValueError(
            f"{OVERRIDE_ENV}={text!r}: expected 'huge' or 'small', ':' and a thread count 0-16, e.g. 'small:0'"
        )
    return PageStrategy(kind == "huge", int(threads), f"set by {OVERRIDE_ENV}")


def machine_facts() -> MachineFacts:
    """Read this machine's facts (Linux sysfs; on other systems: cores only)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return MachineFacts(cores, _huge_page_mode(), _free_page_reporting())


def page_strategy_here() -> PageStrategy:
    """This process's strategy: the override if set (a bad one is logged and ignored), else the choice."""
    override = os.environ.get(OVERRIDE_ENV, "").strip()
    if override:
        try:
            return parse_override(override)
        except ValueError as e:
            logger.warning("%s; choosing from the machine instead", e)
    return choose_page_strategy(machine_facts())


def _huge_page_mode() -> str:
    try:
        setting = _THP_ENABLED.read_text()
    except OSError:
        return "none"
    start, end = setting.find("["), setting.find("]")
    return setting[start + 1 : end] if 0 <= start < end else "none"


def _free_page_reporting() -> bool:
    """Whether any virtio balloon negotiated free page reporting with its host."""
    try:
        devices = list(_BALLOONS.glob("virtio*"))
    except OSError:
        return False
    for device in devices:
        try:
            features = (device / "features").read_text().strip()
        except OSError:
            continue
        if len(features) > _VIRTIO_BALLOON_F_REPORTING and features[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return True
    return False
