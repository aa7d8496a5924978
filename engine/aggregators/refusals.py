"""A site's refused result, told apart from a bug in the server's checks of it.

A check of a result (a workflow's ``check_result``, an aggregator's ``accept_model``, the checks
of a folded result's layout and tensors) refuses the result by raising `ResultRefused`: that is
the site's doing and the site's loss alone. It is logged without a traceback and reported in the
round's ``refused``. Anything else a check raises (a ValueError from a typo in a custom check, a
KeyError, ...) is a bug in the check, not the site's refusal: it is logged with its traceback and
the result counts as failed (the round's ``failed``, never ``refused``) with a reason that says
so. The round goes on with the other results, so a bug that hits one site's result costs that
result alone; a bug that hits every result leaves the round short, and the job ends with a
`WorkflowError` whose reasons name the bug. The server's round loop (`engine.workflows.RoundLoop`)
and a swarm's aggregating client (`engine.executors.ccwf`) both tell them apart this way.
"""

from __future__ import annotations

import logging

from engine.errors import ResultRefused
from engine.model import shown_round

log = logging.getLogger(__name__)


def bug_reason(error: BaseException) -> str:
    """The reason a result failed because a check raised ``error``, which is not a `ResultRefused`.

    It names the exception and says that the bug is the server's, so nobody blames the site.
    """
    return (
        f"checking the result raised {type(error).__name__}: {error} (a bug in the server's checks, not a "
        "refusal by the site; the traceback is in the server's log)"
    )


def record_refusal(
    error: BaseException,
    client: str,
    current_round: int | None,
    failures: dict[str, str],
    refused: dict[str, str],
    *,
    with_traceback: bool = True,
) -> str:
    """Record why ``client``'s result was not taken: refused by the site's fault, or failed by a bug.

    Args:
        error: What the check raised.
        client: Whose result it was.
        current_round: The round (0-based), for the log; None outside rounds.
        failures: Client -> reason; gets the reason either way.
        refused: Client -> reason; gets it for a `ResultRefused` alone.
        with_traceback: Log a bug's traceback here (off when the caller's caller logs it).

    Returns:
        The reason recorded: the refusal's message, or `bug_reason`.
    """
    shown = shown_round(current_round)
    if isinstance(error, ResultRefused):
        reason = str(error)
        log.warning("result refused: site=%s round=%s reason=%s", client, shown, reason)
        failures[client] = refused[client] = reason
        return reason
    reason = bug_reason(error)
    log.error(
        "result failed: site=%s round=%s reason=%s", client, shown, reason, exc_info=error if with_traceback else None
    )
    failures[client] = reason
    return reason
