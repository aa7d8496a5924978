"""The Client API functions a training script calls (``from engine import client as flare``).

Example:
    >>> from engine import client as flare
    >>> flare.init()
    >>> while flare.is_running():
    ...     model = flare.receive(into=net)       # the weights land in net's own tensors
    ...     if model is None:
    ...         break
    ...     steps = train(net)
    ...     flare.send(FLModel(params=net.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": steps}))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.client.backends import install_backend, installed_backend
from engine.client.distributed import connect_from_environment
from engine.client.handover import HANDED_OVER_MESSAGE, hand_over, is_handed_over
from engine.client.into import Into, targets_of
from engine.client.state import ClientState
from engine.errors import ClientAPIError, ParamsHandedOverError
from engine.model import FLModel

#: Task names that `is_train` and `is_evaluate` recognise.
TRAIN_TASKS = frozenset({"train"})
EVALUATE_TASKS = frozenset({"validate", "evaluate"})


def init() -> None:
    """Connect this script to the executor that runs it (a no-op when already connected).

    Under torchrun (``WORLD_SIZE > 1``) only rank 0 connects; the other ranks get each task from
    it by broadcast in `receive` (see `engine.client.distributed`).
    """
    if installed_backend() is None:
        install_backend(connect_from_environment())


def receive(timeout: float | None = None, *, into: Into | None = None) -> FLModel | None:
    """Wait for the next task and return its model; None when the run is over.

    With ``into`` (a ``torch.nn.Module``, or a dict of tensors by name) the task's weights are
    written into those tensors, the module's own parameters and buffers, instead of new ones:
    the engine places the chunks straight into them as they arrive where it can (CPU tensors,
    contiguous, in either execution mode) and copies them in otherwise, so a script that trains
    a network holds that network and no second model. The returned FLModel's ``params`` are
    then ``into``'s tensors themselves (a module's ``state_dict()`` tensors: the same memory as
    its parameters, ``data_ptr()`` unchanged). Names, shapes and dtypes must match exactly:
    otherwise `IntoMismatchError` names the key, and nothing has been written. A task without
    weights (``submit_model``) leaves ``into`` untouched. Should the transfer itself fail midway
    (the server goes away), the error is raised and ``into`` may hold part of the new weights.

    Args:
        timeout: Seconds to wait; None waits until a task comes or the run ends.
        into: Where the weights go: a module or a dict of tensors; None: new tensors.

    Raises:
        IntoMismatchError: ``into`` does not fit the task's weights (nothing written).
        ClientAPIError: ``into`` is neither a module nor a dict of tensors, or the executor went away.

    Example:
        >>> net = Net()
        >>> while flare.is_running():
        ...     model = flare.receive(into=net)      # net holds the global model now
        ...     if model is None:
        ...         break
        ...     steps = train(net)
        ...     flare.send(FLModel(params=net.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": steps}))
    """
    backend = _backend()
    if into is None:
        item = backend.receive(timeout)
    else:
        item = backend.receive_into(timeout, targets_of(into))
    return item.model if item is not None else None


def send(model: FLModel, clear_cache: bool = True) -> None:
    """Return ``model`` as the result of the task received last.

    With ``clear_cache=True`` (the default, as in NVIDIA FLARE) the params of ``model`` are
    handed to the engine: from the moment `send` returns, ``model.params`` (and the params of
    the received model, where they hold any of the same tensors, as in
    ``FLModel(params=received.params)``) raise `ParamsHandedOverError` on every read; the engine
    serves the tensors to the server and drops them once the server is done with them (it has
    pulled them, or, for a result it folds into its sum, made the round's model; at the latest
    when the next task arrives), so their memory goes back to the tensor pool and the next
    `receive` reuses it. The tensors themselves are
    not touched; a dict or tensor the script keeps by another name stays valid (and keeps its
    memory). Changing them before the result is pulled changes what the server gets.

    Args:
        model: The result: params (full weights or a difference), metrics, meta such as
            ``NUM_STEPS_CURRENT_ROUND``.
        clear_cache: True: hand the params over as above, and forget the received task.
            False: leave both models as they are (the script keeps every tensor, and so the
            memory of the received model and the sent one, until it lets go of them).

    Raises:
        ClientAPIError: No task was received, or the executor went away.
        ParamsHandedOverError: ``model``'s params were handed over by an earlier `send`.
    """
    backend = _backend()
    if backend.current is None:
        raise ClientAPIError("send() without a task: call receive() first and send one result per task")
    if is_handed_over(model):
        raise ParamsHandedOverError(HANDED_OVER_MESSAGE)
    if not clear_cache:
        backend.send(model)
        return
    received = backend.current.model
    # The engine gets an FLModel of its own (the same params), so emptying the script's one
    # below cannot race with an executor thread that is still reading it.
    backend.send(dataclasses.replace(model))
    hand_over(model, received)
    backend.current = None


def is_running() -> bool:
    """True until the job ends."""
    return _backend().is_running()


def get_site_name() -> str:
    """This client's name, e.g. ``site-1``."""
    return _backend().site_name


def get_job_id() -> str:
    """The running job's id."""
    return _backend().job_id


def get_job_sites() -> list[str]:
    """Every client site of the running job, in the same order on every site.

    The runtime hands the list to the client job when it starts it: the simulator its clients
    (``site-1`` .. ``site-N``), a production server the sites it placed the job on. Use
    `get_site_index` and `get_num_sites` to give each site its own part of a data set: they
    work whatever the sites are called.

    Raises:
        ClientAPIError: The client job was started without the list (the fix is in the message).
    """
    backend = _backend()
    if not backend.job_sites:
        raise ClientAPIError(
            f"the job's sites are unknown to {backend.site_name}: its client job was started without them; "
            "start it with `python -m engine.runtime.entry client ... --clients SITE,SITE` (as `flengine run` "
            "and `flengine client start` do), or give each site its shard by an argument of its own"
        )
    return list(backend.job_sites)


def get_site_index() -> int:
    """This site's position in `get_job_sites` (0-based): which shard of the data is this site's.

    Example:
        >>> shard, num_shards = flare.get_site_index(), flare.get_num_sites()
        >>> mine = samples[shard::num_shards]        # at site "lab-c" as at "site-3"

    Raises:
        ClientAPIError: The job's sites are unknown, or do not name this site.
    """
    sites = get_job_sites()
    site = _backend().site_name
    if site not in sites:
        raise ClientAPIError(f"this site {site!r} is not among the job's sites {sites}: the runtime gave a wrong list")
    return sites.index(site)


def get_num_sites() -> int:
    """How many client sites the job runs on: ``len(get_job_sites())``.

    Raises:
        ClientAPIError: The job's sites are unknown.
    """
    return len(get_job_sites())


def client_state() -> ClientState:
    """This site's saved state: what the script keeps across rounds (see `engine.client.state`).

    A virtual client (``flengine run -t``) runs the script's loop afresh for each task, so state
    kept in variables is gone at the next round; state kept here is not.

    Raises:
        ClientAPIError: The runtime gave no state folder (the script runs outside a job).
    """
    folder = _backend().state_dir
    if folder is None:
        raise ClientAPIError("flare.client_state(): this script's runtime keeps no state; run it through a job")
    return ClientState(folder)


def get_task_name() -> str | None:
    """The name of the task received last (``train``, ``validate`` ...), None before the first."""
    current = _backend().current
    return current.task_name if current is not None else None


def is_train() -> bool:
    """Whether the task received last is a training task."""
    return get_task_name() in TRAIN_TASKS


def is_evaluate() -> bool:
    """Whether the task received last is an evaluation task."""
    return get_task_name() in EVALUATE_TASKS


def log(key: str, value: Any) -> None:
    """Record a metric (a number or string) of the current task in the site's metrics log."""
    _backend().log(key, value)


def _backend():
    backend = installed_backend()
    if backend is None:
        raise ClientAPIError("the Client API is not initialised: call flare.init() first")
    return backend
