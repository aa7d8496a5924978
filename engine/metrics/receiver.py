"""`MetricsReceiver`: where the metrics of a job go on the server (TensorBoard, JSON lines, ...)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Metric:
    """One checked metric, as every receiver gets it.

    Attributes:
        site: Who reported it: a client's authenticated name (``site-1``), or the server's own
            name (``server``) for the global model's round metrics.
        key: The metric's name, a plain name (letters, digits, ``_ . : / @ + -``, at most 128
            characters).
        value: A finite number.
        round: The 1-based round it belongs to, None when it was logged outside a round.
        step: Where it goes on a TensorBoard x axis: the round when the key is logged once a
            round, counting on when it is logged several times (see `MetricsIntake`).
        time: When the server received it, seconds since the epoch.
    """

    site: str
    key: str
    value: float
    round: int | None
    step: int
    time: float


class MetricsReceiver(ABC):
    """Writes the metrics of a running job somewhere; a component of the server config.

    The server gives every metric to every component of its config that is a
    `MetricsReceiver` (none configured: a `JsonLinesReceiver` writing ``metrics.jsonl``). It
    calls ``use_workspace(folder)`` with the server's workspace before the first metric, then
    `receive` for each metric (from several threads: one at a time, under the intake's lock),
    and `close` once at the end of the job.

    Example:
        >>> class Printer(MetricsReceiver):
        ...     def receive(self, metric: Metric) -> None:
        ...         print(metric.site, metric.key, metric.round, metric.value)
    """

    def use_workspace(self, workspace: Path) -> None:  # noqa: B027 - optional hook
        """Called at job start with the server's workspace folder, where the files go."""

    @abstractmethod
    def receive(self, metric: Metric) -> None:
        """Record one metric; a receiver that raises is logged and skipped for that metric."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Finish the writes (flush and close files); called once when the job ends."""
