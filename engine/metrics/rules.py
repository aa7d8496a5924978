"""What a metric from the network must look like before the server writes it anywhere.

Every byte of a metric message is the sending site's choice: a key with terminal escapes or a
path in it, a value that is a string, a NaN, a round of 10**18, a million messages a second.
These checks are pure functions; `MetricsIntake` applies them (with the rate limits) to every
metric before a receiver sees it.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from engine.aggregators.rules import METRIC_NAME

#: A site's name as a run folder: one FQCN segment (letters, digits, ``_`` and ``-``, starting
#: with a letter or digit), so never ``..``, a path or an empty name.
SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
#: The longest metric key (as `engine.aggregators.rules.METRIC_NAME` allows).
MAX_KEY_CHARS = 128
#: Rounds above this are not rounds (a site that claims round 10**18 is refused).
MAX_ROUND = 10**9


def check_site_name(site: Any) -> str:
    """Return ``site`` if it is a plain site name, usable as a folder name; raise ValueError otherwise."""
    if not isinstance(site, str) or not SITE_NAME.fullmatch(site):
        raise ValueError(f"site: {str(site)[:80]!r} is not a plain site name (letters, digits, _ and -)")
    return site


def is_metric_key(key: Any) -> bool:
    """Whether ``key`` is a plain metric name: ``[A-Za-z0-9_][A-Za-z0-9_.:/@+-]*``, at most 128 characters."""
    return isinstance(key, str) and len(key) <= MAX_KEY_CHARS and METRIC_NAME.fullmatch(key) is not None


def is_metric_value(value: Any) -> bool:
    """Whether ``value`` is a finite real number (``bool`` is not one; numpy scalars are)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value)


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except (OverflowError, TypeError, ValueError):  # an int beyond any float, say
        return False


def refusal(key: Any, value: Any, current_round: Any) -> str | None:
    """Why a metric cannot be written, or None when it can.

    Args:
        key: Its name.
        value: Its value.
        current_round: The 0-based round it says it belongs to, or None.
    """
    if not is_metric_key(key):
        return "not a plain metric name (letters, digits, _ . : / @ + -; at most 128 characters)"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return f"not a number ({type(value).__name__})"
    if not _finite(value):
        return f"not finite ({str(value)[:40]})"
    if current_round is not None and not (
        isinstance(current_round, int) and not isinstance(current_round, bool) and 0 <= current_round < MAX_ROUND
    ):
        return f"not a round ({str(current_round)[:40]!r})"
    return None
