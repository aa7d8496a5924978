"""What the server job and its client jobs say to each other over their cells."""

from __future__ import annotations

#: Channel of task pulling and result submission.
TASK_CHANNEL = "task"
#: Client -> server: "give me my next task". Reply header ``state``: one of the states below.
TOPIC_GET_TASK = "get"
#: Client -> server: a result (frames: the FOBS Shareable). Header: ``task_id``, ``task_name``.
TOPIC_SUBMIT = "submit"
#: Header of every get and submit: the id of the job the client runs. A server refuses a client
#: of another job (a late process of an earlier job on the same port, say).
HEADER_JOB_ID = "job_id"
#: Header of a task request and of a result: an id the client keeps while it asks again after a
#: timeout or a lost connection, so that a repeat gets the first one's answer (see `engine.runtime.repeats`).
HEADER_REQUEST_ID = "request_id"
#: Worker -> server: "which of my virtual clients have a task now?" (a simulation run with ``-t``).
#: Reply header ``state``: ``task`` with ``clients`` (the names, each then asks with its own
#: cell), ``wait`` with ``retry_s``, or ``end``. The first one also says the worker's clients are ready.
TOPIC_GET_WORK = "work"
#: Server -> client, fire and forget: a task that targets it was just scheduled. A waiting
#: client asks at once instead of at the end of its ``retry_s``.
TOPIC_TASK_READY = "ready"

#: Channel of the metrics a client's training script logs (``flare.log``).
METRICS_CHANNEL = "metrics"
#: Client -> server, fire and forget: one metric. Header: ``job_id``, ``key``, ``value`` (a
#: number), ``round`` (0-based, or None outside a task). The server takes the site from the
#: sender's authenticated name and checks and limits the rest (`engine.metrics.MetricsIntake`).
TOPIC_METRIC = "metric"

#: A task follows: header ``task_name``, ``task_id``; frames: the FOBS Shareable.
STATE_TASK = "task"
#: Nothing for this client now: ask again after ``retry_s`` seconds.
STATE_WAIT = "wait"
#: The job is over: finalize and exit.
STATE_END = "end"

#: Seconds a client waits before asking again when told to wait.
DEFAULT_RETRY_S = 0.2
