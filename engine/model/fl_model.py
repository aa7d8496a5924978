"""`FLModel`: what a training script receives and sends back through the Client API."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class ParamsType(str, Enum):
    """Whether ``FLModel.params`` holds whole weights or a difference to the received ones."""

    FULL = "FULL"
    DIFF = "DIFF"


@dataclass
class FLModel:
    """A model exchanged between the server and a training script.

    Attributes:
        params: Parameter name -> tensor (or array), e.g. a ``state_dict()``.
        params_type: Whether ``params`` are full weights or a difference; None when no params.
        metrics: Metric name -> value, e.g. ``{"accuracy": 0.93}``.
        meta: Anything else, e.g. ``{"NUM_STEPS_CURRENT_ROUND": 100}`` (see `MetaKey`).
        current_round: The round this model belongs to (0-based), when known.
        total_rounds: How many rounds the workflow runs, when known.
        start_round: The round the workflow started from.
    """

    params: dict[str, Any] | None = None
    params_type: ParamsType | None = None
    metrics: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    current_round: int | None = None
    total_rounds: int | None = None
    start_round: int = 0

    def __post_init__(self) -> None:
        if self.params is not None and self.params_type is None:
            self.params_type = ParamsType.FULL


def shown_round(current_round: Any) -> Any:
    """A round as users count it (from 1) in logs, errors and events; ``current_round`` counts from 0.

    Anything but an int (None, or whatever a peer's header claims) is shown as it is.

    Example:
        >>> shown_round(0), shown_round(None), shown_round("7")
        (1, None, '7')
    """
    return current_round + 1 if type(current_round) is int else current_round
