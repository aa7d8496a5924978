"""The Client API that training scripts use: ``from engine import client as flare``.

`init`, `receive`, `send`, `is_running`, `get_site_name`, `get_job_id`, `get_task_name`,
`is_train`, `is_evaluate` and `log`; `get_site_index`, `get_num_sites` and `get_job_sites`, this
site's place among the job's sites (its data shard, whatever the site is called);
`fedprox_loss`, FedProx's proximal term for the script's loss, and `ScaffoldClient`, SCAFFOLD's
control variates and step correction; `client_state`, what the script keeps for its site across
rounds (a virtual client runs the loop afresh for each task). The script runs in
a thread of the client process (``execution_mode = in_process``) or as its own process
(``subprocess``); the calls are the same.

``receive(into=net)`` writes the task's weights into the network's own tensors (see
`engine.client.into`). ``send(model)`` hands ``model.params`` to the engine (``clear_cache=True``, the default): reading
them afterwards raises `ParamsHandedOverError`, and the memory is reused by the next ``receive()``
(see `engine.client.handover`).
"""

from engine.client.api import (
    client_state,
    get_job_id,
    get_job_sites,
    get_num_sites,
    get_site_index,
    get_site_name,
    get_task_name,
    init,
    is_evaluate,
    is_running,
    is_train,
    log,
    receive,
    send,
)
from engine.client.exchange import TaskExchange, TaskItem
from engine.client.fedprox import fedprox_loss
from engine.client.handover import HandedOverParams
from engine.client.scaffold import ScaffoldClient
from engine.client.state import ClientState
from engine.errors import ClientAPIError, IntoMismatchError, ParamsHandedOverError
from engine.model import FLModel, ParamsType

__all__ = [
    "ClientAPIError",
    "FLModel",
    "HandedOverParams",
    "IntoMismatchError",
    "ParamsHandedOverError",
    "ParamsType",
    "ClientState",
    "ScaffoldClient",
    "TaskExchange",
    "TaskItem",
    "client_state",
    "fedprox_loss",
    "get_job_id",
    "get_job_sites",
    "get_num_sites",
    "get_site_index",
    "get_site_name",
    "get_task_name",
    "init",
    "is_evaluate",
    "is_running",
    "is_train",
    "log",
    "receive",
    "send",
]
