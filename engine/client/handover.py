"""What ``flare.send(model)`` does to the script's FLModels: their tensors go to the engine.

With ``clear_cache=True`` (the default, as in NVIDIA FLARE) `send` hands the params of the sent
FLModel over: the engine serves them to whoever pulls the result (the server, or in
``subprocess`` mode the executor) and drops them once it is done with them (at the latest when
the next task arrives), and the script's FLModel gets a
`HandedOverParams` in their place. The received FLModel whose tensors went into the sent one is
emptied the same way, so nothing in the script keeps the previous round's model alive while
the next one arrives: its memory goes back to the tensor pool, and the next ``receive()``
reuses it.

Example:
    >>> m = flare.receive()
    >>> for t in m.params.values():
    ...     t.add_(0.01)
    >>> flare.send(FLModel(params=m.params))
    >>> m.params["w"]
    Traceback (most recent call last):
    ParamsHandedOverError: the params of this FLModel were handed to the engine by ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

from engine.errors import ParamsHandedOverError
from engine.model import FLModel

HANDED_OVER_MESSAGE = (
    "the params of this FLModel were handed to the engine by flare.send(..., clear_cache=True); "
    "keep a copy before send, or pass clear_cache=False"
)


class HandedOverParams(Mapping[str, Any]):
    """Stands in for the params `flare.send` took: every read raises `ParamsHandedOverError`.

    ``repr`` still works (a debugger or a log line may show the model), and a new dict may be
    assigned to ``model.params`` at any time.
    """

    __slots__ = ()

    def __getitem__(self, key: str) -> NoReturn:
        _refuse()

    def __iter__(self) -> Iterator[str]:
        _refuse()

    def __len__(self) -> int:
        _refuse()

    def __contains__(self, key: object) -> bool:
        _refuse()

    def __bool__(self) -> bool:
        _refuse()

    def __eq__(self, other: object) -> bool:
        _refuse()

    __hash__ = None  # type: ignore[assignment]

    def keys(self) -> NoReturn:  # type: ignore[override]
        _refuse()

    def values(self) -> NoReturn:  # type: ignore[override]
        _refuse()

    def items(self) -> NoReturn:  # type: ignore[override]
        _refuse()

    def get(self, key: str, default: Any = None) -> NoReturn:
        _refuse()

    def __getattr__(self, name: str) -> Any:
        # dict methods the script may reach for (copy, update, pop ...): the same clear error,
        # not "has no attribute"; private and dunder lookups (copy, pickle) stay ordinary.
        if name.startswith("_"):
            raise AttributeError(name)
        _refuse()

    def __repr__(self) -> str:
        return "<params handed to the engine by flare.send(); read them before send, or send with clear_cache=False>"


def _refuse() -> NoReturn:
    raise ParamsHandedOverError(HANDED_OVER_MESSAGE)


#: The one stand-in: it holds nothing.
HANDED_OVER = HandedOverParams()


def is_handed_over(model: FLModel) -> bool:
    """Whether ``model``'s params were handed to the engine by an earlier `flare.send`."""
    return isinstance(model.params, HandedOverParams)


def hand_over(sent: FLModel, received: FLModel | None) -> None:
    """Empty ``sent.params``, and ``received.params`` where they hold any of the same tensors.

    Call it once the engine holds the params by other references (its own FLModel, a download):
    from then on the script's FLModels keep none of the tensors alive.

    Args:
        sent: The FLModel the script passed to `flare.send`.
        received: The FLModel of the task it answered (from `flare.receive`), or None.
    """
    params = sent.params
    if params is None or isinstance(params, HandedOverParams):
        return
    sent.params = HANDED_OVER
    if received is None or received is sent or not isinstance(received.params, Mapping):
        return
    if isinstance(received.params, HandedOverParams):
        return
    if received.params is params or _storages(received.params.values()) & _storages(params.values()):
        received.params = HANDED_OVER


def _storages(values: Any) -> set[tuple[str, int]]:
    """Keys of the memory behind ``values``: a tensor's storage address, else the object's identity.

    Two tensors on one storage (``t.detach()``, a view) keep each other's memory alive, so a
    received dict that holds a view of a sent tensor pins it as surely as the tensor itself.
    """
    keys: set[tuple[str, int]] = set()
    for value in values:
        keys.add(_storage_of(value) or ("object", id(value)))
    return keys


def _storage_of(value: Any) -> tuple[str, int] | None:
    storage = getattr(value, "untyped_storage", None)
    if not callable(storage):
        return None
    try:
        address = storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
        return None
    return (str(value.device), address) if address else None
