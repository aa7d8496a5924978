"""``flare.receive(into=...)``: a task's weights land in the script's own tensors.

A script that trains a network passes it (or a dict of tensors) to `receive`; the received
params are written into its parameters and buffers, so the script holds that network and
nothing else: no second model arrives beside it. Where it can, the engine places the chunks
straight into those tensors as they arrive (`placement_of`, used with
`MessageCodec.decode`'s ``place``); otherwise it receives the model into new memory and copies
it in (`fill_into`). Either way the names, shapes and dtypes are checked first: a mismatch is an
`IntoMismatchError` naming the key, raised before anything is written.

Example:
    >>> net = Net()
    >>> model = flare.receive(into=net)          # net's own tensors now hold the global model
    >>> model.params["fc.weight"].data_ptr() == net.fc.weight.data_ptr()
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.errors import ClientAPIError, IntoMismatchError
from engine.model import FLModel, ParamsType, model_from_shareable
from engine.streaming.via_downloader import StreamedItem

#: How many names a mismatch message lists before it says "and N more".
_NAMES_SHOWN = 5

#: What ``into`` may be.
Into = nn.Module | Mapping[str, torch.Tensor]


def targets_of(into: Any) -> dict[str, torch.Tensor]:
    """The tensors ``into`` stands for, by name: a module's state dict, or a dict's tensors.

    The tensors are detached views of the module's own parameters and buffers (the same memory),
    so writing into them under ``torch.no_grad`` changes the module and no autograd graph.

    Raises:
        ClientAPIError: ``into`` is neither a module nor a mapping of names to tensors.
    """
    if isinstance(into, nn.Module):
        return dict(into.state_dict(keep_vars=False))
    if not isinstance(into, Mapping):
        raise ClientAPIError(
            f"receive(into=...): expected a torch.nn.Module or a dict of tensors, got {type(into).__name__}"
        )
    targets = {}
    for name, tensor in into.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ClientAPIError(
                f"receive(into=...): key {name!r} holds a {type(tensor).__name__}; into must map names to tensors"
            )
        targets[name] = tensor.detach()
    return targets


def placement_of(peeked: Any, targets: Mapping[str, torch.Tensor]) -> dict[StreamedItem, torch.Tensor]:
    """Which streamed tensors of a task go into which of ``targets`` (for ``MessageCodec.decode``).

    ``peeked`` is the task as rebuilt before anything is pulled: an `FLModel`, or a `Shareable`
    that carries one (or a DXO of weights). Nothing is placed (an empty dict) unless its params
    are FULL weights whose names are exactly those of ``targets``; shapes and dtypes are checked
    by the consumer against the stream's header. Whatever is not placed lands in new memory,
    and `fill_into` names the mismatch before anything is written.
    """
    model = peeked
    if not isinstance(model, FLModel):
        try:
            model = model_from_shareable(peeked)
        except (ValueError, KeyError, TypeError, AttributeError):
            return {}
    params = model.params
    if model.params_type is ParamsType.DIFF or not isinstance(params, Mapping) or set(params) != set(targets):
        return {}
    return {item: targets[name] for name, item in params.items() if isinstance(item, StreamedItem)}


def fill_into(targets: Mapping[str, torch.Tensor], model: FLModel) -> FLModel:
    """``model`` with its params written into ``targets``, and the targets as its params.

    Tensors already in place (the engine put the chunks straight into them) are left as they
    are; the others are copied in. A model without params (a task that carries no weights, such
    as ``submit_model``) leaves the targets untouched and is returned as it is.

    Raises:
        IntoMismatchError: A name is missing or extra, or a shape or dtype differs, or the
            params are a DIFF; the message names the key, and no target has changed.
    """
    params = model.params
    if params is None or (isinstance(params, Mapping) and not params):
        return model
    if not isinstance(params, Mapping):
        raise IntoMismatchError(f"receive(into=...): the task's params are a {type(params).__name__}, not a dict")
    if model.params_type is ParamsType.DIFF:
        raise IntoMismatchError(
            "receive(into=...): the task carries a DIFF (weight differences), which would overwrite the weights; "
            "receive it without into"
        )
    values = {name: _as_tensor(name, value) for name, value in params.items()}
    _check_names(targets, values)
    for name, target in targets.items():
        value = values[name]
        if value.dtype != target.dtype:
            raise IntoMismatchError(
                f"receive(into=...): {name!r} arrived as {value.dtype}, the target is {target.dtype}; "
                "convert the model (e.g. net.to(dtype)) to match the server's"
            )
        if value.shape != target.shape:
            raise IntoMismatchError(
                f"receive(into=...): {name!r} arrived with shape {tuple(value.shape)}, "
                f"the target has {tuple(target.shape)}; build the same architecture as the server's model"
            )
    with torch.no_grad():
        for name, target in targets.items():
            value = values[name]
            if not _same_memory(value, target):
                target.copy_(value)
    # A new FLModel: the received one may be held elsewhere too (a Swarm or cross-site
    # evaluation controller keeps the model it ran the task with).
    return dataclasses.replace(model, params=dict(targets))


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(value)
        except TypeError as e:
            raise IntoMismatchError(f"receive(into=...): {name!r} arrived as an array torch cannot hold: {e}") from e
    raise IntoMismatchError(f"receive(into=...): {name!r} arrived as a {type(value).__name__}, not a tensor")


def _check_names(targets: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    missing = [name for name in targets if name not in values]
    extra = [name for name in values if name not in targets]
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(f"missing from the task: {_names(missing)}")
    if extra:
        parts.append(f"not in the target: {_names(extra)}")
    raise IntoMismatchError(
        f"receive(into=...): the task's params and the target differ ({'; '.join(parts)}); "
        "build the same model as the server's, or receive without into"
    )


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:_NAMES_SHOWN])
    return shown if len(names) <= _NAMES_SHOWN else f"{shown} and {len(names) - _NAMES_SHOWN} more"


def _same_memory(value: torch.Tensor, target: torch.Tensor) -> bool:
    return value.device == target.device and value.data_ptr() == target.data_ptr() and value.nbytes == target.nbytes
