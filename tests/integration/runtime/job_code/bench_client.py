"""The BENCHMARK.md client update, with faults to order for tests.

Site k adds ``k * 0.001`` to every parameter and reports ``NUM_STEPS_CURRENT_ROUND = k * 100``.
``--fault KIND --fault-site SITE --fault-round R`` makes that site misbehave in that round
(0-based): raise, kill (its whole client process: in the first round from R on that the site
trains, once, so a process started again in its folder trains on), bad_shape, sleep (``--sleep-s``),
pause (before it receives its task of round R, counted from 0: it writes ``.paused-SITE`` next to
this script and waits for the test to write ``.go-SITE``; the task's tensors are pulled after).
``--pause SITE:N`` (repeatable) pauses that site before its task N, whatever ``--fault`` says, and
``--hold SITE:N`` (repeatable) once it received task N (its tensors here): it writes
``.paused-SITE-N`` (``.holding-SITE-N``) and waits for ``.go-SITE-N``, at most 300 s.
Cross-site evaluation: ``submit_model`` sends the site's last trained model, ``validate`` the
mean of the received parameters as the metric ``mean``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch

from engine import client as flare
from engine.model import FLModel

parser = argparse.ArgumentParser()
parser.add_argument("--fault", choices=["none", "raise", "kill", "bad_shape", "sleep", "pause"], default="none")
parser.add_argument("--fault-site", default="site-2")
parser.add_argument("--fault-round", type=int, default=0)
parser.add_argument("--sleep-s", type=float, default=30.0)
parser.add_argument("--pause", action="append", default=[], metavar="SITE:N")
parser.add_argument("--hold", action="append", default=[], metavar="SITE:N")
args = parser.parse_args()

flare.init()
site = flare.get_site_name()
k = int(site.rsplit("-", 1)[-1])
last = None
received = 0


def pause_here(marker: str = "paused", name: str = "", wait_s: float = 60.0) -> None:
    """Tell the test that this site is about to pull its task (or holds it), and wait until it says go.

    ``name``: what the marker and go files are named after (the site by default).
    """
    folder = os.path.dirname(os.path.abspath(__file__))
    name = name or site
    open(os.path.join(folder, f".{marker}-{name}"), "w").close()
    go = os.path.join(folder, f".go-{name}")
    deadline = time.monotonic() + wait_s
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)


while flare.is_running():
    if args.fault == "pause" and site == args.fault_site and received == args.fault_round:
        pause_here()
    elif f"{site}:{received}" in args.pause:
        pause_here("paused", f"{site}-{received}", 300.0)
    received += 1
    model = flare.receive()
    if model is None:
        break
    if f"{site}:{received - 1}" in args.hold:
        pause_here("holding", f"{site}-{received - 1}", 300.0)
    if flare.get_task_name() == "submit_model":
        flare.send(FLModel(params=last or {}))
        continue
    if flare.is_evaluate():
        values = torch.cat([tensor.double().flatten() for tensor in model.params.values()])
        flare.send(FLModel(metrics={"mean": values.mean().item()}))
        continue
    faulty = args.fault != "none" and site == args.fault_site and model.current_round == args.fault_round
    if args.fault == "kill" and site == args.fault_site and model.current_round >= args.fault_round:
        marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".killed-once-{site}")
        faulty = not os.path.exists(marker)  # once: a process started again afterwards trains on
        open(marker, "w").close()
    if faulty and args.fault == "raise":
        raise RuntimeError(f"injected failure on {site} in round {model.current_round}")
    if faulty and args.fault == "kill":
        os.kill(os.getppid() if os.environ.get("FLENGINE_CLIENT_API_ENDPOINT") else os.getpid(), signal.SIGKILL)
    if faulty and args.fault == "sleep":
        time.sleep(args.sleep_s)
    params = {name: tensor + k * 0.001 for name, tensor in model.params.items()}
    if faulty and args.fault == "bad_shape":
        name = next(iter(params))
        params[name] = torch.zeros(3, 3)
    last = params
    flare.send(FLModel(params=params, meta={"NUM_STEPS_CURRENT_ROUND": k * 100}))
