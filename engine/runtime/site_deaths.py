"""`SiteDeaths`: how a job's server process learns that a client site is dead, and what it does then.

A site is dead when its parent says its job process exited (`client_exited`; a simulation's
worker that exits takes its virtual clients with it), when its key is revoked (`site_revoked`),
or when the monitor finds it silent past the heartbeat timeout. `_mark_dead` records it
(`engine.runtime.liveness`), ends its open tasks CLIENT_DEAD, makes the cell forget it so that
requests waiting for it fail now, and stops waiting for it to pull the task's model.
"""

from __future__ import annotations

import contextlib
import logging

from engine.errors import CellError

log = logging.getLogger("engine.runtime.server")  # the server job's log lines


class SiteDeaths:
    """The dead-site handling of `ServerJob`; the attributes it reads are `ServerJob`'s."""

    def client_exited(self, site: str, code: int | None = None) -> None:
        """``site``'s job process ended (its parent saw it): it is dead at once, not after the heartbeat timeout.

        Called by the runtime's parent (the simulator's launcher, the server daemon) from any thread.
        A simulation's worker that exits takes its virtual clients with it.
        """
        if self._worker_exited(site, code):
            return
        if not self.liveness.is_client(site):
            log.warning("exit notice ignored: %r is not a client of this job", site)
            return
        reason = "its process exited" if code is None else f"its process exited with code {code}"
        self._mark_dead(site, reason)

    def site_revoked(self, site: str) -> None:
        """``site``'s key left the project's allowlist: the job's port refuses it from now on, and it is dead.

        Called by the server daemon (on the job process's stdin) when a reloaded kit removes the site.
        """
        if not self.liveness.is_client(site):
            log.warning("revocation notice ignored: %r is not a client of this job", site)
            return
        self.liveness.revoke(site)  # `run` leaves it out of the job's allowlist if it has not built it yet
        endpoint = getattr(self, "endpoint", None)
        allowlist = endpoint.cell.allowlist if endpoint is not None else None
        if allowlist is not None:
            allowlist.keep_only(set(allowlist.identities()) - {site})
        self._mark_dead(site, "revoked: its key left the server's allowlist")

    def _gone(self, target: str) -> str | None:
        """Why ``target`` (a cell of a site) is dead, or None."""
        return self.liveness.dead().get(target.split(".", 1)[0])

    def _mark_dead(self, site: str, reason: str, unregister: bool = True, quiet: bool = False) -> bool:
        """``site`` is dead: its open tasks end CLIENT_DEAD and workflows leave it out; False once it was.

        With ``unregister`` (its process ended, or it was revoked: the cell does not know yet) the
        cell forgets it at once, so requests waiting for its replies fail now, not at the timeout.
        ``quiet``: no log line and no progress event (a worker's death reports its clients' at once).
        """
        with self._lock:
            if site in self._told_end:  # it heard END_RUN and left: no death
                return False
        if not self.liveness.mark_dead(site, reason):
            return False
        if not quiet:
            log.warning("client dead site=%s reason=%s", site, reason)
            self.report("client_dead", site=site, reason=reason)
        cell = getattr(self, "cell", None)
        if cell is not None and unregister:
            with contextlib.suppress(CellError):  # requests waiting for it fail now, not at the timeout
                cell.forget_peer(site, f"{site} is dead: {reason}")
        with self._lock:  # nobody waits for a dead site to finish pulling its task's model
            refs = [ref for offers in self._offers_of_task.values() for ref in offers]
            for task_id in [task_id for task_id, (owner, _) in self._task_offers.items() if owner == site]:
                refs.extend(self._task_offers.pop(task_id)[1])  # its own downloads too (filtered, or again)
            refs = list(dict.fromkeys(refs))
        repeats = getattr(self, "repeats", None)
        if repeats is not None:
            repeats.forget(site)
        endpoint = getattr(self, "endpoint", None)
        if refs and endpoint is not None and endpoint.service is not None:
            endpoint.service.drop_receiver(refs, site)
        return True
