"""Fully qualified cell names (FQCN): ``server``, ``site-1``, ``site-1.job-7``.

An FQCN is one or more dot-separated segments of letters, digits, ``_`` and ``-`` (each segment
starts with a letter or digit). The first segment names the site or the server; further
segments name child cells, such as the cell of one job on that site.
"""

from __future__ import annotations

import functools
import re

from engine.cells.protocol import MAX_FQCN_CHARS

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9_-]*"
_FQCN_RE = re.compile(rf"{_SEGMENT}(?:\.{_SEGMENT})*")


def is_valid_fqcn(name: object) -> bool:
    """Tell whether ``name`` is a well-formed FQCN.

    Args:
        name: Any value, typically read from the network.

    Returns:
        True for a string that matches the FQCN grammar and is at most 255 characters.
    """
    return isinstance(name, str) and _is_valid_str(name)


@functools.lru_cache(maxsize=4096)  # every envelope names two cells, and there are few cells
def _is_valid_str(name: str) -> bool:
    return 0 < len(name) <= MAX_FQCN_CHARS and _FQCN_RE.fullmatch(name) is not None


def check_fqcn(name: object, what: str = "fqcn") -> str:
    """Return ``name`` if it is a valid FQCN, else raise a ValueError saying why.

    Args:
        name: The candidate name.
        what: How to call the value in the message (an argument or key name).

    Returns:
        The name, unchanged.

    Raises:
        ValueError: If the name is not a string of dot-separated segments.
    """
    if not is_valid_fqcn(name):
        raise ValueError(
            f"{what}: {name!r} is not a valid cell name; use dot-separated segments of "
            "letters, digits, '_' and '-' such as 'server', 'site-1' or 'site-1.job1'"
        )
    return name  # type: ignore[return-value]


def root_of(fqcn: str) -> str:
    """Return the first segment of an FQCN (``site-1`` for ``site-1.job1``)."""
    return fqcn.split(".", 1)[0]


def parent_of(fqcn: str) -> str | None:
    """Return the parent of a child FQCN, or None for a root name."""
    head, sep, _ = fqcn.rpartition(".")
    return head if sep else None
