"""`Shareable`: the dict that tasks and results travel in, with headers and a return code."""

from __future__ import annotations

from enum import Enum
from typing import Any

_HEADERS_KEY = "__headers__"


class ReturnCode(str, Enum):
    """How a client's task ended, as reported in its result."""

    OK = "OK"
    EXECUTION_EXCEPTION = "EXECUTION_EXCEPTION"
    TASK_UNKNOWN = "TASK_UNKNOWN"
    TASK_ABORTED = "TASK_ABORTED"
    BAD_TASK_DATA = "BAD_TASK_DATA"
    EMPTY_RESULT = "EMPTY_RESULT"


class ReservedHeaderKey:
    """Header keys the engine sets on tasks and results (plain strings)."""

    TASK_NAME = "task_name"
    TASK_ID = "task_id"
    CURRENT_ROUND = "current_round"
    TOTAL_ROUNDS = "total_rounds"
    RETURN_CODE = "return_code"
    PEER_NAME = "peer_name"


class Shareable(dict):  # type: ignore[type-arg]
    """A dict of task data or results plus headers (task name, round, return code ...)."""

    def set_header(self, key: str, value: Any) -> None:
        """Set header ``key`` (a `ReservedHeaderKey` value or an application's own name)."""
        self.setdefault(_HEADERS_KEY, {})[key] = value

    def get_header(self, key: str, default: Any = None) -> Any:
        """Return header ``key``, or ``default``."""
        return self.get(_HEADERS_KEY, {}).get(key, default)

    @property
    def headers(self) -> dict[str, Any]:
        """All headers, by name."""
        return self.get(_HEADERS_KEY, {})

    def set_return_code(self, code: ReturnCode) -> None:
        """Record how the task ended."""
        self.set_header(ReservedHeaderKey.RETURN_CODE, code.value)

    def get_return_code(self, default: ReturnCode = ReturnCode.OK) -> ReturnCode:
        """Return how the task ended (``OK`` when nothing says otherwise)."""
        value = self.get_header(ReservedHeaderKey.RETURN_CODE)
        return ReturnCode(value) if value is not None else default


def make_reply(code: ReturnCode) -> Shareable:
    """Return an empty result that carries only ``code``."""
    reply = Shareable()
    reply.set_return_code(code)
    return reply
