"""`payload_bytes`: how many bytes of tensors and arrays a message carries (what was streamed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.model import DXO, FLModel
from engine.streaming.lazy import LazyRef


def payload_bytes(value: Any) -> int:
    """Bytes of tensor and array memory in a result (what was streamed)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, LazyRef):
        return value.nbytes
    if isinstance(value, FLModel):
        return payload_bytes(value.params)
    if isinstance(value, dict):  # a Shareable too
        return sum(payload_bytes(item) for item in value.values())
    if isinstance(value, DXO):
        return payload_bytes(value.data)
    return 0
