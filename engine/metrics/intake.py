"""`MetricsIntake`: the server's one way in for metrics: checked, limited per site, numbered, handed on.

Clients send each number their training script logs (``flare.log(key, value)``) as a small
fire-and-forget message; the server job passes each to `MetricsIntake.from_site` with the
sender's authenticated name, and the global model's round metrics to `from_server`. A metric
that passes the checks of `engine.metrics.rules` and the sending site's limits goes to every
receiver, one at a time.

Limits per site (`MetricLimits`, so that one site cannot fill the server's disk or log): at most
``per_second`` metrics a second on average with bursts of ``burst``, ``per_site`` in the whole
job and ``keys_per_site`` distinct keys. With the defaults a site writes at most 100,000 metrics
(about 15 MB of JSON lines and 5 MB of TensorBoard events). What is over a limit, or refused by
the checks, is dropped; the log says so in a few lines a minute, not one per metric.

Steps: each (site, key) counts on from the round. A key logged once a round gets its 1-based
round as step (1, 2, 3 ...; a round the site skipped is a gap); a key logged several times a
round gets ``max(round, previous step + 1)``: round 1 logging it 3 times gives steps 1, 2, 3,
round 2 then 4, 5, 6. Steps never go back, so TensorBoard draws one line per key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cells.log_limit import LogLimiter
from engine.metrics.jsonl import JsonLinesReceiver
from engine.metrics.receiver import Metric, MetricsReceiver
from engine.metrics.rules import SITE_NAME, refusal

log = logging.getLogger(__name__)

#: Log lines about dropped metrics: a few per kind of line a minute, whatever the sites send.
DROPS = LogLimiter(burst=5, interval_s=60.0)


@dataclass(frozen=True)
class MetricLimits:
    """How many metrics one site may have written (the server's own round metrics are not limited).

    Attributes:
        per_second: Average metrics a second a site may send (a token bucket refilled at this rate).
        burst: Metrics a site may send at once, above the average (the bucket's size).
        per_site: Metrics of one site written in the whole job; later ones are dropped.
        keys_per_site: Distinct keys of one site; a metric with a further key is dropped.
    """

    per_second: float = 100.0
    burst: int = 1000
    per_site: int = 100_000
    keys_per_site: int = 1000

    def __post_init__(self) -> None:
        for name in ("per_second", "burst", "per_site", "keys_per_site"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}: expected a number > 0, got {value!r}")


@dataclass
class _Site:
    """What the intake remembers of one site: its token bucket, its count and each key's last step."""

    tokens: float
    refilled: float
    written: int = 0
    steps: dict[str, int] = field(default_factory=dict)


class MetricsIntake:
    """Checks, limits and numbers the metrics of a job, and gives each to every receiver.

    Args:
        receivers: Where the metrics go (each gets every metric).
        sites: The clients of the job: the only senders `from_site` takes.
        server_name: The server's own name, the site of `from_server`'s metrics (and so the
            name of the global run); a client of that name is refused.
        limits: How many metrics one site may have written.
        clock: Monotonic seconds (for the rate limit).
        wall_clock: Seconds since the epoch (a metric's time).
    """

    def __init__(
        self,
        receivers: Sequence[MetricsReceiver],
        sites: Iterable[str],
        server_name: str = "server",
        limits: MetricLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.receivers = list(receivers)
        self.server_name = server_name
        self.limits = limits or MetricLimits()
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._closed = False
        now = clock()
        names = {site for site in sites if SITE_NAME.fullmatch(site) and site != server_name}
        self._sites = {site: _Site(float(self.limits.burst), now) for site in names}
        self._server = _Site(0.0, now)
        #: How many metrics were written, and dropped by reason (``refused``, ``rate``, ``total``,
        #: ``keys``, ``sender``, ``closed``).
        self.written = 0
        self.dropped: Counter[str] = Counter()

    @classmethod
    def for_components(
        cls, components: Mapping[str, Any], workspace: Path, sites: Iterable[str], server_name: str = "server"
    ) -> MetricsIntake:
        """The intake of a server job: every component that is a `MetricsReceiver`, in config order.

        With none, the metrics go to ``<workspace>/metrics.jsonl`` (a `JsonLinesReceiver`).
        """
        receivers = [component for component in components.values() if isinstance(component, MetricsReceiver)]
        if not receivers:
            default = JsonLinesReceiver()
            default.use_workspace(workspace)
            receivers = [default]
        return cls(receivers, sites, server_name)

    def from_site(self, site: str, key: Any, value: Any, current_round: Any = None) -> bool:
        """Take a metric a client sent; True if it was written.

        Args:
            site: The sender's authenticated name (never a name the message carries).
            key: The metric's name, as sent.
            value: Its value, as sent.
            current_round: The 0-based round the client was training, as sent, or None.
        """
        with self._lock:
            state = self._sites.get(site)
            if state is None:
                return self._drop("sender", site, key, "not a client of this job")
            why = refusal(key, value, current_round)
            if why is not None:
                return self._drop("refused", site, key, why)
            if state.written >= self.limits.per_site:
                return self._drop("total", site, key, f"over per_site={self.limits.per_site} metrics in this job")
            if not self._take_token(state):
                return self._drop("rate", site, key, f"over {self.limits.per_second:g} metrics a second")
            return self._write(site, state, key, value, current_round)

    def from_server(self, metrics: Any, current_round: Any = None) -> int:
        """Take the global model's round metrics (a dict); return how many were written.

        Args:
            metrics: Name -> value, as a workflow's ``round_done`` event carries them.
            current_round: The 0-based round they belong to.
        """
        if not isinstance(metrics, Mapping):
            return 0
        written = 0
        with self._lock:
            for key, value in metrics.items():
                why = refusal(key, value, current_round)
                if why is not None:
                    self._drop("refused", self.server_name, key, why)
                elif self._write(self.server_name, self._server, key, value, current_round):
                    written += 1
        return written

    def close(self) -> None:
        """Close every receiver (each once, even if one raises); later metrics are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for receiver in self.receivers:
                try:
                    receiver.close()
                except Exception:
                    log.exception("metrics receiver failed to close receiver=%s", type(receiver).__name__)

    def _take_token(self, state: _Site) -> bool:
        now = self._clock()
        state.tokens = min(float(self.limits.burst), state.tokens + (now - state.refilled) * self.limits.per_second)
        state.refilled = now
        if state.tokens < 1.0:
            return False
        state.tokens -= 1.0
        return True

    def _write(self, site: str, state: _Site, key: str, value: Any, current_round: int | None) -> bool:
        if self._closed:
            return self._drop("closed", site, key, "the job's metrics are closed")
        last = state.steps.get(key)
        if last is None and len(state.steps) >= self.limits.keys_per_site:
            return self._drop("keys", site, key, f"over keys_per_site={self.limits.keys_per_site} distinct keys")
        round_number = None if current_round is None else current_round + 1
        step = max(round_number or 0, (last or 0) + 1)
        state.steps[key] = step
        state.written += 1
        metric = Metric(site, key, float(value), round_number, step, self._wall_clock())
        for receiver in self.receivers:
            try:
                receiver.receive(metric)
            except Exception as e:
                DROPS.warning(
                    log, "metrics receiver failed receiver=%s site=%s key=%s: %s", type(receiver).__name__, site, key, e
                )
        self.written += 1
        return True

    def _drop(self, reason: str, site: str, key: Any, why: str) -> bool:
        self.dropped[reason] += 1
        shown = key[:80] if isinstance(key, str) else type(key).__name__
        DROPS.warning(log, "metric dropped site=%s key=%r reason=%s", site, shown, why)
        return False
