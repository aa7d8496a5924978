"""Asking again: a bounded retry with backoff for requests that meet a timeout or a lost connection.

A request that times out, or whose target is not connected right now (a dropped connection,
a reconnect in progress, a network hiccup), is asked again after a backoff that doubles each
time, at most ``retries`` times. Every attempt is a new request with a new message id, so a
late reply to an attempt already given up on never answers a later one: the cell drops it
(counted as ``late_replies``). A target that stays unreachable for longer than ``away_limit_s``
(the cell's heartbeat timeout: it is gone, not hiccuping) ends the retries at once. A reply with
an error status (the peer refused) is never retried.

Example:
    >>> policy = RetryPolicy(retries=3, backoff_s=0.5)
    >>> [policy.wait_s(attempt) for attempt in (1, 2, 3)]
    [0.5, 1.0, 2.0]
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.cells.message import Message
from engine.cells.protocol import STOP_POLL_S, Status
from engine.errors import CellTimeoutError, CellUnreachableError

if TYPE_CHECKING:
    from engine.cells.cell import Cell

log = logging.getLogger(__name__)

#: Retries of one request by default (``streaming_retries``).
DEFAULT_RETRIES = 5
#: Seconds before the first retry by default (``streaming_retry_backoff_s``); doubled for each next one.
DEFAULT_RETRY_BACKOFF_S = 1.0
#: The longest wait between two attempts, in seconds, however many retries came before.
MAX_RETRY_WAIT_S = 30.0
#: The reply statuses worth asking again for: nobody refused, the answer just did not come.
RETRYABLE = frozenset({Status.TIMEOUT, Status.UNREACHABLE})


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often, and after how long, a failed request is asked again.

    Attributes:
        retries: Retries after the first attempt, >= 0 (0: never ask again).
        backoff_s: Seconds before the first retry, > 0; each next wait doubles, up to
            `MAX_RETRY_WAIT_S`.
        away_limit_s: Seconds a target may stay unreachable (counted from the first
            unreachable answer since it last replied) before the retries end; None: the cell's
            ``heartbeat_timeout_s``.
        gone: Says why a target is known to be gone for good (its process ended), or None: a
            failed request to such a target is not asked again (the runtime's liveness).
    """

    retries: int = DEFAULT_RETRIES
    backoff_s: float = DEFAULT_RETRY_BACKOFF_S
    away_limit_s: float | None = None
    gone: Callable[[str], str | None] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if type(self.retries) is not int or self.retries < 0:
            raise ValueError(f"retries: expected an integer >= 0, got {self.retries!r}")
        if not _positive(self.backoff_s):
            raise ValueError(f"backoff_s: expected seconds > 0, got {self.backoff_s!r}")
        if self.away_limit_s is not None and not _positive(self.away_limit_s):
            raise ValueError(f"away_limit_s: expected seconds > 0 or None, got {self.away_limit_s!r}")

    def wait_s(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1 for the first)."""
        return min(self.backoff_s * 2.0 ** max(0, attempt - 1), MAX_RETRY_WAIT_S)

    def window_s(self) -> float:
        """Seconds all the retries wait together (how long a receiver may stay quiet while it retries)."""
        return sum(self.wait_s(attempt) for attempt in range(1, self.retries + 1))

    def limit_for(self, cell: Cell) -> float:
        """`away_limit_s`, or the heartbeat timeout of ``cell`` when it is None."""
        return self.away_limit_s if self.away_limit_s is not None else cell.settings.heartbeat_timeout_s


#: Never ask again: the behaviour of a request without a policy.
NO_RETRY = RetryPolicy(retries=0)


class Absence:
    """When a target started being unreachable, for the `RetryPolicy.away_limit_s` check (thread-safe).

    Args:
        limit_s: Seconds of unreachability after which the target counts as gone.
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._since: float | None = None
        self._lock = threading.Lock()

    def heard(self) -> None:
        """The target answered (any reply it sent itself): it is not away."""
        with self._lock:
            self._since = None

    def unreachable(self, now_s: float) -> float:
        """Record an unreachable answer at ``now_s``; return how long the target has been away, in seconds."""
        with self._lock:
            if self._since is None:
                self._since = now_s
            return now_s - self._since

    def away_s(self, now_s: float) -> float:
        """Seconds the target has been unreachable (0 while it is not)."""
        with self._lock:
            return 0.0 if self._since is None else now_s - self._since


def give_up_reason(
    status: Status,
    reason: str,
    attempt: int,
    policy: RetryPolicy,
    absence: Absence,
    now_s: float,
    target: str | None = None,
) -> str | None:
    """Why a failed attempt is final, or None: ask again.

    Args:
        status: The failed attempt's status (not ok).
        reason: Its reason, for the message.
        attempt: Retries made so far for this request (0: the first attempt failed).
        policy: The retry policy.
        absence: The target's unreachability so far; updated for an unreachable status.
        now_s: Monotonic time of the failure.
        target: The request's target, for the policy's ``gone`` (a target known gone is final).
    """
    if status not in RETRYABLE:
        return reason
    known_gone = policy.gone(target) if policy.gone is not None and target is not None else None
    if known_gone:
        return f"{reason}; {target} is gone: {known_gone}"
    if status is Status.UNREACHABLE:
        away_s = absence.unreachable(now_s)
        if away_s > absence.limit_s:
            return (
                f"{reason}; the peer has been unreachable for {away_s:.1f} s, longer than its heartbeat "
                f"timeout ({absence.limit_s:g} s, cell.heartbeat_timeout_s): it is gone"
            )
    if attempt >= policy.retries:
        if not policy.retries:
            return reason
        return f"{reason}; gave up after {attempt} retries (streaming_retries = {policy.retries})"
    return None


def request_with_retries(
    cell: Cell,
    target: str,
    channel: str,
    topic: str,
    header: Mapping[str, Any] | None = None,
    frames: Sequence[Any] = (),
    timeout_s: float | None = None,
    policy: RetryPolicy = NO_RETRY,
    stop: threading.Event | None = None,
) -> Message:
    """`Cell.request`, asked again after a timeout or a lost connection as ``policy`` says.

    The same header and frames go out with each attempt (so a handler that must not act twice
    keys on something in the header, such as a task id). While a client cell is not connected,
    a wait ends early once it is again.

    Args:
        cell: The requesting cell.
        target, channel, topic, header, frames, timeout_s: As `Cell.request` (``timeout_s``
            bounds each attempt).
        policy: Retries and backoff; `NO_RETRY` asks once.
        stop: Set to end the wait and the retries early: a wait for a reply fails as closed
            (`CellClosedError`), a retry is not asked (the last failure is raised).

    Returns:
        The ok reply.

    Raises:
        CellError: The ``Cell*Error`` of the last attempt once the retries are over; after a
            retry its message also says why they ended (retries used, or the peer away beyond
            its heartbeat timeout). A refusal (`CellRemoteError`) or a closed cell is never
            retried.
    """
    absence = Absence(policy.limit_for(cell))
    attempt = 0
    while True:
        try:
            return cell.request(target, channel, topic, header, frames, timeout_s, stop)
        except (CellTimeoutError, CellUnreachableError) as e:
            status = Status.TIMEOUT if isinstance(e, CellTimeoutError) else Status.UNREACHABLE
            why = give_up_reason(status, str(e), attempt, policy, absence, time.monotonic(), target)
            if why is not None:
                if why == str(e):
                    raise
                raise type(e)(why) from e
            if stop is not None and stop.is_set():
                raise
        attempt += 1
        pause_s = policy.wait_s(attempt)
        log.warning(
            "request failed, asking again target=%s channel=%s topic=%s status=%s retry=%d/%d in_s=%.2f",
            target, channel, topic, status.value, attempt, policy.retries, pause_s,
        )  # fmt: skip
        _pause(cell, pause_s, stop)


def _pause(cell: Cell, wait_s: float, stop: threading.Event | None) -> None:
    """Wait ``wait_s`` seconds or until ``stop``; a client cell that is not connected stops waiting once it is."""
    if not cell.connected and not cell.is_server:
        deadline = time.monotonic() + wait_s
        while not cell.wait_connected(min(STOP_POLL_S, max(0.0, deadline - time.monotonic()))):
            if (stop is not None and stop.is_set()) or time.monotonic() >= deadline:
                return
    elif stop is not None:
        stop.wait(wait_s)
    else:
        time.sleep(wait_s)
