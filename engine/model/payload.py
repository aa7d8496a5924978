"""`payload_bytes`: how many bytes of tensors and arrays a message carries (what was streamed).

And how much a result may announce against the model it was made from (`result_limit`).
"""

from __future__ import annotations

from typing import Any

from engine.model.dxo import DXO
from engine.model.fl_model import FLModel

#: A result may announce at most this many times the bytes of the model it was made from (a
#: float64 result of a float32 model), plus `RESULT_SLACK_BYTES`; more is refused before it is pulled.
RESULT_SIZE_FACTOR = 2
RESULT_SLACK_BYTES = 16 << 20


def payload_bytes(value: Any) -> int:
    """Bytes of tensor and array memory in a message or result (what was streamed).

    Tensors, arrays and lazy values count by their ``nbytes``; models, DXOs and dicts (a
    Shareable too) by what they hold; anything else counts 0.
    """
    if isinstance(value, FLModel):
        return payload_bytes(value.params)
    if isinstance(value, DXO):
        return payload_bytes(value.data)
    if isinstance(value, dict):
        return sum(payload_bytes(item) for item in value.values())
    nbytes = getattr(value, "nbytes", None)
    return nbytes if type(nbytes) is int else 0


def result_limit(model_bytes: int) -> int:
    """The most bytes a result of a model of ``model_bytes`` may announce."""
    return RESULT_SIZE_FACTOR * model_bytes + RESULT_SLACK_BYTES


def limits_after(model_bytes: int | None, what: str) -> dict[str, Any]:
    """``MessageCodec.decode``'s ``max_bytes`` and ``what`` for a message made from a model of ``model_bytes``.

    ``what`` names the message (``"a result of site-1"``); nothing (no bound) when ``model_bytes`` is None.
    """
    if model_bytes is None:
        return {}
    bound = f"at most {RESULT_SIZE_FACTOR} x the model of {model_bytes} bytes it was made from"
    return {"max_bytes": result_limit(model_bytes), "what": f"{what} ({bound})"}
