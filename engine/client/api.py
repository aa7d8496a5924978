"""The Client API functions a training script calls (``from engine import client as flare``).

Example:
    >>> from engine import client as flare
    >>> flare.init()
    >>> while flare.is_running():
    ...     model = flare.receive()
    ...     if model is None:
    ...         break
    ...     net.load_state_dict(model.params)
    ...     steps = train(net)
    ...     flare.send(FLModel(params=net.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": steps}))
"""

from __future__ import annotations

from typing import Any

from engine.client.backends import SubprocessBackend, install_backend, installed_backend
from engine.client.exchange import ClientAPIError
from engine.model import FLModel

#: Task names that `is_train` and `is_evaluate` recognise.
TRAIN_TASKS = frozenset({"train"})
EVALUATE_TASKS = frozenset({"validate", "evaluate"})


def init() -> None:
    """Connect this script to the executor that runs it (a no-op when already connected)."""
    if installed_backend() is None:
        install_backend(SubprocessBackend.from_environment())


def receive(timeout: float | None = None) -> FLModel | None:
    """Wait for the next task and return its model; None when the run is over.

    Args:
        timeout: Seconds to wait; None waits until a task comes or the run ends.
    """
    item = _backend().receive(timeout)
    return item.model if item is not None else None


def send(model: FLModel, clear_cache: bool = True) -> None:
    """Return ``model`` as the result of the task received last.

    Args:
        model: The result: params (full weights or a difference), metrics, meta such as
            ``NUM_STEPS_CURRENT_ROUND``.
        clear_cache: Drop the engine's references to the received model, so its tensors can be
            freed once the script lets go of them too.
    """
    backend = _backend()
    if backend.current is None:
        raise ClientAPIError("send() without a task: call receive() first and send one result per task")
    backend.send(model)
    if clear_cache:
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
