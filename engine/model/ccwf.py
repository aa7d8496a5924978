"""What the two sides of a client-controlled workflow (Swarm, cross-site evaluation) agree on.

The server side (`engine.workflows.ccwf`) configures the clients, starts the workflow and follows
the status reports; the client side (`engine.executors.ccwf`) does the work and talks to its peers.
Both use these names, so they live below both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

#: Cell channel of status reports (client -> server) and of peer messages (client -> client).
CCWF_CHANNEL = "ccwf"
#: Client -> server, fire and forget: a `WorkflowStatus` as the header.
TOPIC_STATUS = "status"

#: Task name suffixes (after ``<prefix>_``) the server side sends.
CONFIG_TASK = "config"
START_TASK = "start"
#: Swarm: play the round again with another aggregation client (its data: `REPLAY_ROUND_KEY`, `REPLAY_EXCLUDE_KEY`).
REPLAY_TASK = "replay"
REPLAY_ROUND_KEY, REPLAY_EXCLUDE_KEY = "round", "exclude"
#: Swarm: the server lost these clients for good (its data: `LOST_KEY`, every client lost so far;
#: with `STARTS_AGAIN_KEY`, the aggregation client that sends the first round's model in place of
#: the lost starting client).
LOST_TASK = "lost"
LOST_KEY = "lost"
STARTS_AGAIN_KEY = "starts_again"
EVAL_TASK = "eval"

#: Keys of the config a server side sends with its ``<prefix>_config`` task.
CONFIG_KEY = "ccwf_config"
#: Key of the global model names the cross-site eval's global model client answers the config with.
GLOBAL_MODELS_KEY = "global_models"
#: Keys of a cross-site eval task: whose model, and which one.
MODEL_OWNER_KEY = "model_owner"
MODEL_NAME_KEY = "model_name"
#: The name of an evaluatee's own (local) model in cross-site evaluation.
LOCAL_MODEL = "local"


def rotate(clients: list[str], current_round: int) -> list[str]:
    """``clients`` starting at the round's turn: aggregation moves from client to client.

    A Swarm round goes to the first of them that takes it (the server side knows whose turn it is).
    """
    start = current_round % len(clients)
    return clients[start:] + clients[:start]


@dataclass
class WorkflowStatus:
    """Where one client is in a client-controlled workflow; sent to the server as a header.

    Attributes:
        workflow: The workflow's task name prefix (``swarm``, ``cse``).
        round: The round the client works on (None before the first).
        aggr: That round's aggregation client, as the round's model named it ("" before the first).
        phase: What it does now (``configured``, ``training``, ``aggregating``, ``idle`` ...).
        progress: A counter the client raises at every step forward (the server's
            ``progress_timeout`` watches the counters of all clients).
        error: Why the client cannot go on; the server ends the job with it.
        all_done: The workflow finished (the final model is with the result clients).
        rounds_done: Rounds this client aggregated: ``{round, time_s, metrics, clients}``.
        sent: When the report was made (``time.time()``).
    """

    workflow: str
    round: int | None = None
    aggr: str = ""
    phase: str = "configured"
    progress: int = 0
    error: str | None = None
    all_done: bool = False
    rounds_done: list[dict[str, Any]] = field(default_factory=list)
    sent: float = field(default_factory=time.time)

    def to_header(self) -> dict[str, Any]:
        """The status as a msgpack-friendly dict."""
        return {
            "workflow": self.workflow,
            "round": self.round,
            "aggr": self.aggr,
            "phase": self.phase,
            "progress": self.progress,
            "error": self.error,
            "all_done": self.all_done,
            "rounds_done": list(self.rounds_done),
            "sent": self.sent,
        }

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> WorkflowStatus:
        """Rebuild a status from a received header; a malformed one raises `ValueError`."""
        try:
            return cls(
                workflow=str(header["workflow"]),
                round=None if header.get("round") is None else int(header["round"]),
                aggr=str(header.get("aggr") or ""),
                phase=str(header.get("phase", "")),
                progress=int(header.get("progress", 0)),
                error=None if header.get("error") is None else str(header["error"]),
                all_done=bool(header.get("all_done", False)),
                rounds_done=[dict(entry) for entry in header.get("rounds_done") or []],
                sent=float(header.get("sent", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            # Not the header itself: a peer chose it, up to a MiB of it.
            raise ValueError(f"malformed workflow status: {type(e).__name__}: {e}") from e
