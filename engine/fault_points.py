"""Fault points: places where a test makes a job process die at a precise moment, as a crash would.

Set ``FLENGINE_FAULT_POINT=SITE/NAME`` (or ``SITE/NAME@N``) in the environment a job process
starts with: the N-th time (the first by default) the process of ``SITE`` passes the point
``NAME``, it kills itself with SIGKILL, exactly what a crash or a power cut does at that moment.
The fault suite (tests/faults/) uses them to test recovery at the worst times: mid-checkpoint,
mid-aggregation, mid-download. Unset, as always outside tests, a point costs one lookup.

Points: ``workflow_started`` (the server job process recorded that a workflow runs),
``checkpoint_write`` (a workflow's checkpoint: the model linked, the record not yet renamed),
``result_aggregated`` (a result just went into the round's sum), ``chunk_served`` (a chunk of a
download was just sent), ``swarm_round_sending`` (a Swarm client is about to send a round's model:
the starting client's first round, the round after one it aggregated and reported done, or a
round it sends again), ``swarm_final_sent`` (the last round's aggregation client sent the final
model to the result clients and has not reported the swarm done).
"""

from __future__ import annotations

import os
import signal
import threading
import time

#: The environment variable that names the point, ``SITE/NAME[@N]``.
FAULT_POINT_ENV = "FLENGINE_FAULT_POINT"

_lock = threading.Lock()
_passes: dict[str, int] = {}
_site = ""


def set_site(site: str) -> None:
    """Name this process's site (the job process does it at start)."""
    global _site
    _site = site


def fault_point(name: str, settle_s: float = 0.0) -> None:
    """SIGKILL this process if ``FLENGINE_FAULT_POINT`` names this site, this point and this pass.

    ``settle_s``: seconds to wait before the kill, for a point whose test needs what the process
    sent just before it to have left (a crash a moment later); its threads go on meanwhile.
    """
    wanted = os.environ.get(FAULT_POINT_ENV)
    if not wanted:
        return
    where, _, nth = wanted.partition("@")
    site, _, point = where.rpartition("/")
    if point != name or site != _site:
        return
    with _lock:
        passes = _passes[name] = _passes.get(name, 0) + 1
    if passes == (int(nth) if nth.isdigit() else 1):
        time.sleep(settle_s)
        os.kill(os.getpid(), signal.SIGKILL)
