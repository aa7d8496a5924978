"""The BENCHMARK.md client update, with faults to order for tests.

Site k adds ``k * 0.001`` to every parameter and reports ``NUM_STEPS_CURRENT_ROUND = k * 100``.
``--fault KIND --fault-site SITE --fault-round R`` makes that site misbehave in that round
(0-based): raise, kill (its whole client process), bad_shape, sleep (``--sleep-s``).
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
parser.add_argument("--fault", choices=["none", "raise", "kill", "bad_shape", "sleep"], default="none")
parser.add_argument("--fault-site", default="site-2")
parser.add_argument("--fault-round", type=int, default=0)
parser.add_argument("--sleep-s", type=float, default=30.0)
args = parser.parse_args()

flare.init()
site = flare.get_site_name()
k = int(site.rsplit("-", 1)[-1])
last = None
while flare.is_running():
    model = flare.receive()
    if model is None:
        break
    if flare.get_task_name() == "submit_model":
        flare.send(FLModel(params=last or {}))
        continue
    if flare.is_evaluate():
        values = torch.cat([tensor.double().flatten() for tensor in model.params.values()])
        flare.send(FLModel(metrics={"mean": values.mean().item()}))
        continue
    faulty = args.fault != "none" and site == args.fault_site and model.current_round == args.fault_round
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
