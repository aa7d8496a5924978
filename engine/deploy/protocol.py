"""What the server daemon, the client daemons and admin sessions say to each other over their cells.

Every connection is the server daemon's cell (``server``, bound on the kit's port) and a client
of it: a client daemon (``site-1``), or an admin session (``alice.<token>``, a child cell of the
admin's identity, so that two commands of one admin can run at once). The server takes each
sender's identity from its key (the cells layer), never from a header.

A job runs in job processes of its own (``python -m engine.runtime.entry``): the server's binds
one of the server's job ports, and each site's connects to it, exactly as in the simulator.
"""

from __future__ import annotations

#: Admin session -> server daemon: one request per command; header ``command`` and its args.
ADMIN_CHANNEL = "admin"
#: The one topic of the admin channel.
TOPIC_COMMAND = "command"

#: Server daemon <-> client daemons.
SITE_CHANNEL = "site"
#: Client -> server, fire and forget, every few seconds: header ``running`` (job ids), ``resources``.
TOPIC_STATUS = "status"
#: Server -> client request: prepare a job (check the site's policy, download, verify and unpack
#: it; start nothing yet). Header: ``job_id``, ``name``, ``submitter``, ``org``, ``port``, ``ref``
#: (the job archive offered to the site), ``digest`` (its sha256), ``size``, ``sites`` (every
#: client site the job runs on, in one order for all: the Client API's ``get_site_index``).
#: Reply header: ``accepted`` (bool) and ``reason`` when not.
TOPIC_DEPLOY = "deploy"
#: Server -> client request, once every site of the job accepted it: start the prepared job's
#: process (header ``job_id``). A job refused by any site is dropped with `TOPIC_ABORT` instead,
#: so no site runs a byte of a job that does not run everywhere.
TOPIC_START = "start"
#: Server -> client request: stop a job's process now, or drop a prepared job (``job_id``, ``reason``).
TOPIC_ABORT = "abort"
#: Client -> server, fire and forget: a job process of this site ended (``job_id``, ``code``).
TOPIC_JOB_ENDED = "job_ended"
#: Client -> server, fire and forget: a job process of this site crashed and is started again
#: (``job_id``, ``code``); the job's server process leaves the site out until it is back.
TOPIC_JOB_PROCESS_EXITED = "job_process_exited"
#: Server -> client request, after the server restarted: start the process of a job this site
#: ran again (``job_id``, ``port``, ``sites``), stopping one still running; the job resumes from
#: its server's checkpoint. Reply header: ``resumed`` (bool) and ``reason`` when not.
TOPIC_RESUME = "resume"
#: Server -> client request: stop the client daemon (its job processes first).
TOPIC_SHUTDOWN = "shutdown"

#: Seconds between two status messages of a client daemon.
STATUS_INTERVAL_S = 2.0
#: Seconds after which a site that sent no status counts as gone (for scheduling and `clients`): three statuses missed.
STATUS_TIMEOUT_S = 6.0
#: How often a client daemon starts a crashed job process of one job again, and the pause first.
MAX_JOB_RESTARTS = 3
JOB_RESTART_DELAY_S = 1.0
#: Seconds the end of a job waits for its sites' job processes to end and hand in their results
#: (a download of the job's results waits for them as long).
RESULTS_WAIT_S = 30.0
#: Seconds a site has to download, check and start a deployed job.
DEPLOY_TIMEOUT_S = 120.0
#: Largest job archive the server takes from an admin, or a site from the server.
MAX_JOB_ARCHIVE_BYTES = 1 << 30
#: Most bytes of a job's workspace packed for ``download`` (and unpacked by the admin): the
#: server's own folder (its models, over 1 GiB for a 1 GiB model) and every site's results.
RESULTS_MAX_BYTES = 64 << 30
#: Most files and folders of a job's workspace packed for ``download``.
RESULTS_MAX_FILES = 100_000
#: Most client sites one job runs on (a deployment naming more is malformed): their names, up
#: to 64 characters each, go on the job process's command line as one argument (at most 128 KiB).
MAX_JOB_SITES = 1000
#: Chunk size of job archive and result downloads.
ARCHIVE_CHUNK_BYTES = 1 << 20
#: How many job ports the server uses by default, after its own port (``port + 1`` on).
DEFAULT_JOB_PORTS = 10
