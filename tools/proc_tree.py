"""What the benchmarks read of a process tree from outside, in ``/proc``: members, RSS, PSS, liveness."""

from __future__ import annotations

import os
from pathlib import Path

#: One page, in MiB (``statm`` counts pages).
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def process_tree(root_pid: int) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of ``root_pid`` and its descendants."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        table[int(entry)] = (parent, cmdline)
    tree, frontier = {}, [root_pid]
    while frontier:
        pid = frontier.pop()
        if pid in table:
            tree[pid] = table[pid]
        frontier.extend(child for child, (parent, _) in table.items() if parent == pid)
    return tree


def rss_mb(pid: int) -> float:
    """RSS of ``pid`` in MiB (0 when it is gone): cheap, from ``statm``."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_MB
    except (OSError, IndexError, ValueError):
        return 0.0


def pss_mb(pid: int) -> float:
    """PSS of ``pid`` in MiB (0 when it is gone): costly, it walks the whole address space."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0.0


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"
