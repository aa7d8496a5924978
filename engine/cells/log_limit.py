"""`LogLimiter`: log lines about what peers send, at most a few per minute per kind of line.

Refusals are logged because an operator must see an attack or a misconfigured site, but each
line is written because of a message a peer chose to send: a peer that sends a million forged
messages must not write a million lines to the server's disk. A limiter lets the first
``burst`` lines of each kind through in every ``interval_s`` window, counts the rest, and says
how many it held back with the next line of that kind that gets through.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

#: Lines of one kind written per window before the rest are only counted.
DEFAULT_BURST = 20
#: Length of a window, in seconds.
DEFAULT_INTERVAL_S = 60.0


class LogLimiter:
    """Rate-limits log lines by kind (the format string), thread-safe.

    The kinds are the format strings of the call sites, a fixed and small set; the arguments
    (peer names, reasons) never make a new kind, so a peer cannot grow the limiter's state.

    Args:
        burst: Lines of one kind let through per window.
        interval_s: Window length in seconds.

    Example:
        >>> LIMITER = LogLimiter()
        >>> LIMITER.warning(logger, "message refused: %s", why)
    """

    def __init__(self, burst: int = DEFAULT_BURST, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self._burst = burst
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._windows: dict[str, list[float | int]] = {}  # kind -> [window start, written, held back]

    def reset(self) -> None:
        """Forget every window (each kind of line gets its full budget again)."""
        with self._lock:
            self._windows.clear()

    def warning(self, logger: logging.Logger, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` as a warning unless this kind of line is over its budget; True if written."""
        return self.log(logger, logging.WARNING, msg, *args)

    def log(self, logger: logging.Logger, level: int, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless this kind of line is over its budget; True if written."""
        now = time.monotonic()
        with self._lock:
            window = self._windows.setdefault(msg, [now, 0, 0])
            held_back = 0
            if now - window[0] >= self._interval_s:
                held_back = int(window[2])
                window[:] = [now, 0, 0]
            if window[1] >= self._burst:
                window[2] += 1
                return False
            window[1] += 1
        if held_back:
            logger.log(
                level, msg + " (and %d more like it in the last %g s, not logged)", *args, held_back, self._interval_s
            )
        else:
            logger.log(level, msg, *args)
        return True


#: The limiter of every line the cells layer writes about what a peer sent (refusals, drops).
REFUSALS = LogLimiter()
