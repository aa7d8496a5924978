"""POC mode: a whole deployed project on this machine, for trying production mode out.

A POC folder (``./poc`` by default) holds::

    poc/
      project.conf        the project: server on 127.0.0.1, site-1 .. site-N, the admin "admin"
      kits/<name>/        the startup kits `engine.provision.provision` wrote from it
      workspaces/<name>/  each daemon's workspace; daemon.txt is its stdout and stderr
      run/<name>.pid      one pid file per daemon that `start` started (see `engine.deploy.pidfile`)

`prepare` writes the project file and the kits (again after an edit: existing keys are kept),
`start` runs the server and every site as background processes and waits until every site is
connected, `status` says what runs, and `stop` ends exactly the processes `start` started.
Jobs go in with the POC's admin kit: ``flengine admin poc/kits/admin submit jobs/fedavg``.
Public API::

    from engine.deploy.poc import prepare, start, status, stop
"""

from __future__ import annotations

from engine.deploy.poc.daemons import start, status, stop
from engine.deploy.poc.folder import DEFAULT_FOLDER, Daemon, PocError, PocFolder, PocReport
from engine.deploy.poc.prepare import DEFAULT_PORT, DEFAULT_SITES, PrepareReport, prepare, project_text, taken_ports

__all__ = [
    "DEFAULT_FOLDER",
    "DEFAULT_PORT",
    "DEFAULT_SITES",
    "Daemon",
    "PocError",
    "PocFolder",
    "PocReport",
    "PrepareReport",
    "prepare",
    "project_text",
    "start",
    "status",
    "stop",
    "taken_ports",
]
