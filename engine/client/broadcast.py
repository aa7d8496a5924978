"""How rank 0 hands a task to the other ranks of a torchrun launch: broadcasts over gloo.

`TaskChannel` wraps one broadcast function (``torch.distributed.broadcast`` from rank 0 in a
gloo group) and sends small states, then a task: a FOBS header (the task name, the FLModel
without its tensors, and the layout of its params) and then every torch tensor and numeric numpy
array as raw bytes, in slices of `BROADCAST_SLICE_BYTES`. The other ranks write those bytes
straight into new CPU memory, or into the script's own tensors for ``receive(into=...)``, so
no rank holds a second copy of the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from engine import fobs
from engine.client.exchange import TaskItem
from engine.errors import ClientAPIError
from engine.fobs.dtypes import dtype_name, torch_dtype
from engine.fobs.tensor_pool import pooled_empty
from engine.model import FLModel, ParamsType

#: Bytes broadcast in one call (a large tensor goes in slices of this size).
BROADCAST_SLICE_BYTES = 64 << 20

# How a param travels: as raw bytes of a torch tensor or numpy array, or inside the FOBS header.
_TORCH, _NUMPY, _OBJECT = "torch", "numpy", "object"


class TaskChannel:
    """Broadcasts from rank 0 in one process group: states and tasks.

    Args:
        broadcast: Broadcasts a flat CPU tensor from rank 0, in place on every rank (a
            collective call: every rank calls the channel's methods in the same order).
    """

    def __init__(self, broadcast: Callable[[torch.Tensor], None]) -> None:
        self._broadcast = broadcast

    # ----------------------------------------------------------------- plain values

    def send_state(self, state: int) -> None:
        """Rank 0: one number (what the other ranks are to do next)."""
        self._broadcast(torch.tensor([state], dtype=torch.int64))

    def receive_state(self) -> int:
        """Ranks > 0: the number rank 0 sent."""
        value = torch.zeros(1, dtype=torch.int64)
        self._broadcast(value)
        return int(value.item())

    def _send_sizes(self, sizes: list[int]) -> None:
        self._broadcast(torch.tensor([len(sizes)], dtype=torch.int64))
        if sizes:
            self._broadcast(torch.tensor(sizes, dtype=torch.int64))

    def _receive_sizes(self) -> list[int]:
        count = torch.zeros(1, dtype=torch.int64)
        self._broadcast(count)
        if not count.item():
            return []
        sizes = torch.zeros(int(count.item()), dtype=torch.int64)
        self._broadcast(sizes)
        return [int(size) for size in sizes.tolist()]

    # ----------------------------------------------------------------- a task

    def send_task(self, item: TaskItem) -> None:
        """Rank 0: the task's name, FLModel (params aside) and layout, then each tensor's bytes."""
        header, frames, raw = pack_task(item)
        buffers = [memoryview(header), *(memoryview(frame) for frame in frames)]
        self._send_sizes([buffer.nbytes for buffer in buffers])
        for buffer in buffers:
            self._broadcast_bytes(_writable_bytes(buffer))
        for value in raw:
            self._broadcast_bytes(_byte_tensor(value))

    def receive_task(self, targets: dict[str, Any] | None = None) -> TaskItem:
        """Ranks > 0: the task rank 0 sent, its tensors written straight into new CPU memory
        (or into ``targets`` when every one fits: same names, dtypes and shapes, CPU, contiguous)."""
        sizes = self._receive_sizes()
        if not sizes:
            raise ClientAPIError("rank 0 sent a task without a header")
        buffers = [torch.empty(size, dtype=torch.uint8) for size in sizes]
        for buffer in buffers:
            self._broadcast_bytes(buffer)
        header, *frames = (buffer.numpy() for buffer in buffers)
        layout = fobs.deserialize(header, frames)
        del buffers, header, frames

        def fill(value: Any) -> None:
            self._broadcast_bytes(_byte_tensor(value))

        return unpack_task(layout, fill, targets)

    # ----------------------------------------------------------------- transport

    def _broadcast_bytes(self, data: Any) -> None:
        """Broadcast a flat uint8 tensor, in slices of `BROADCAST_SLICE_BYTES`."""
        for start in range(0, data.numel(), BROADCAST_SLICE_BYTES):
            self._broadcast(data[start : start + BROADCAST_SLICE_BYTES])


def pack_task(item: TaskItem) -> tuple[bytes, list[memoryview], list[Any]]:
    """Split a task into what rank 0 broadcasts: a FOBS header (+ frames) and the raw params.

    The header holds the task name, the FLModel without its tensors and arrays, and the layout
    of every param (name, how it travels, dtype, shape) in the params' order; the raw params
    (contiguous CPU torch tensors and numeric numpy arrays) follow in that order as bytes.
    """
    model = item.model
    params = model.params if isinstance(model.params, Mapping) else None
    layout: list[list[Any]] = []
    kept: dict[str, Any] = {}
    raw: list[Any] = []
    for name, value in (params or {}).items():
        travel = _raw_form(value)
        if travel is None:
            layout.append([name, _OBJECT, None, None])
            kept[name] = value
            continue
        kind, dtype, contiguous = travel
        layout.append([name, kind, dtype, list(contiguous.shape)])
        raw.append(contiguous)
    rest = dataclasses.replace(model, params=kept if params is not None else model.params)
    header, frames = fobs.serialize({"task_name": item.task_name, "model": rest, "layout": layout})
    return header, frames, raw


def unpack_task(document: Any, fill: Any, targets: dict[str, Any] | None = None) -> TaskItem:
    """The task of a `pack_task` header; ``fill(value)`` writes each raw param's bytes into ``value``.

    With ``targets`` whose tensors all fit the task's (`_placement`), the bytes go straight into them.
    """
    if not isinstance(document, dict) or not isinstance(document.get("model"), FLModel):
        raise ClientAPIError("rank 0 sent a malformed task")
    model: FLModel = document["model"]
    kept = model.params if isinstance(model.params, dict) else {}
    placed = _placement(model, document["layout"], targets)
    params: dict[str, Any] = {}
    for name, kind, dtype, shape in document["layout"]:
        if kind == _OBJECT:
            params[name] = kept[name]
            continue
        if name in placed:
            value = placed[name]
        elif kind == _TORCH:
            value = pooled_empty(shape, torch_dtype(dtype))
        elif kind == _NUMPY:
            value = np.empty(shape, dtype=_numeric_dtype(dtype))
        else:
            raise ClientAPIError(f"rank 0 sent param {name!r} of unknown kind {kind!r}")
        fill(value)
        params[name] = value
    model = dataclasses.replace(model, params=params if model.params is not None else None)
    return TaskItem(str(document["task_name"]), model)


def _placement(model: FLModel, layout: list[list[Any]], targets: dict[str, Any] | None) -> dict[str, Any]:
    """The targets to broadcast straight into: all of them when every one fits, else none.

    All or nothing, so that a mismatch (which `fill_into` names) leaves every target as it was.
    """
    if not targets or model.params_type is ParamsType.DIFF or {entry[0] for entry in layout} != set(targets):
        return {}
    for name, kind, dtype, shape in layout:
        target = targets[name]
        fits = (
            kind == _TORCH
            and isinstance(target, torch.Tensor)
            and target.device.type == "cpu"
            and target.is_contiguous()
            and target.dtype == torch_dtype(dtype)
            and list(target.shape) == list(shape)
        )
        if not fits:
            return {}
    return dict(targets)


def _raw_form(value: Any) -> tuple[str, str, Any] | None:
    """How ``value`` travels as raw bytes: ``(kind, dtype name, contiguous value)``; None: in the header."""
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided or value.is_quantized:
            return None  # FOBS says what is wrong with it
        try:
            name = dtype_name(value.dtype)
        except Exception:  # noqa: BLE001 - an unsupported dtype: FOBS names it
            return None
        return _TORCH, name, value.detach().to("cpu").contiguous()
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and value.dtype.byteorder in "=|<":
        return _NUMPY, value.dtype.str, np.ascontiguousarray(value)
    return None


def _numeric_dtype(name: Any) -> np.dtype:
    dtype = np.dtype(str(name))
    if dtype.kind not in "biufc":
        raise ClientAPIError(f"rank 0 sent an array of dtype {name!r}; only numeric arrays travel raw")
    return dtype


def _byte_tensor(value: Any) -> torch.Tensor:
    """A contiguous tensor or array as a flat uint8 tensor over the same memory."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.reshape(-1).view(np.uint8)) if value.size else torch.empty(0, dtype=torch.uint8)
    return value.reshape(-1).view(torch.uint8)


def _writable_bytes(buffer: memoryview) -> Any:
    """A buffer as a flat uint8 tensor (copied when it is read-only, as a header's bytes are)."""
    data = np.frombuffer(buffer if not buffer.readonly else bytearray(buffer), dtype=np.uint8)
    return torch.from_numpy(data) if data.size else torch.empty(0, dtype=torch.uint8)
