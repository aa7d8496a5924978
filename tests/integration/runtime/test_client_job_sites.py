"""A client job process is told the job's sites (``--clients``): a list without its own site stops it at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_a_client_started_with_a_site_list_that_leaves_it_out_exits_naming_the_fix(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "engine.runtime.entry", "client",
        "--job", str(REPO / "jobs" / "fedavg"), "--workspace", str(tmp_path), "--site", "lab-c",
        "--clients", "lab-a,lab-b", "--connect", "tcp://127.0.0.1:9", "--insecure",
    ]  # fmt: skip

    done = subprocess.run(command, capture_output=True, text=True, timeout=120)

    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "Error: lab-c: --clients lab-a,lab-b does not name this site; list every client site of the job"
    )
