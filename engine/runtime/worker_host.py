"""`WorkerHost`: how a job's server process serves the workers of a simulation's virtual clients (part of `ServerJob`).

With ``flengine run -t W`` the clients are virtual: worker processes run them one at a time,
each client with its own cell, which the worker's key may register (the allowlist's delegation,
`engine.cells.security.Allowlist.delegate`). For the server a virtual client is a client like
any other while its cell is connected. Between its turns the client has no cell, and its
worker stands for it: the worker's first request (`protocol.TOPIC_GET_WORK`) makes all its
clients ready, its cell being connected keeps them alive, its process exiting makes them dead
(they are back when a new worker process asks for work), a task scheduled for them is told to
the worker, and the worker hearing END_RUN is all of them hearing it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from engine.cells import Message, Reply, Status
from engine.runtime import protocol

log = logging.getLogger("engine.runtime.server")  # the server job's log lines

#: Most clients named in one answer to a worker (it asks again once it has run them): a header stays small.
MAX_CLIENTS_PER_ANSWER = 256


class WorkerHost:
    """The worker side of `ServerJob`; the attributes it reads are `ServerJob`'s (``workers``: worker -> clients)."""

    workers: Mapping[str, Sequence[str]]

    def _worker_of(self) -> dict[str, str]:
        cached = getattr(self, "_worker_of_client", None)
        if cached is None:
            cached = {client: worker for worker, clients in self.workers.items() for client in clients}
            self._worker_of_client = cached
        return cached

    def _on_get_work(self, message: Message) -> Reply:
        """A worker asks which of its clients have a task now; its clients are ready and alive from now on."""
        worker = message.source
        clients = self.workers.get(worker)
        if clients is None or message.header.get(protocol.HEADER_JOB_ID) != self.job_id:
            log.warning("work request refused: %s is not a worker of this job", worker)
            reason = f"{worker} is not a worker of this job ({self.job_id})"
            return Reply(header={"outcome": "FAILED", "reason": reason}, status=Status.ERROR, reason=reason)
        with self._lock:
            joined = worker not in self._seen_workers
            self._seen_workers.add(worker)
            if joined:
                self._seen.update(clients)
        if joined:
            log.info("worker asked for work worker=%s clients=%d", worker, len(clients))
        if self.queue.ended:
            with self._lock:
                self._told_end.update(clients)
            return Reply(header={"state": protocol.STATE_END})
        worker_of = self._worker_of()  # a new process of a worker that exited: its clients are back
        back = [site for site in self.liveness.dead() if worker_of.get(site) == worker and self.liveness.back(site)]
        if back:
            log.warning("worker back worker=%s clients=%d", worker, len(back))
            self.report("worker_back", site=worker, clients=len(back))
        ready = self.queue.clients_with_work(clients)[:MAX_CLIENTS_PER_ANSWER]
        if not ready:
            return Reply(header={"state": protocol.STATE_WAIT, "retry_s": protocol.DEFAULT_RETRY_S})
        return Reply(header={"state": protocol.STATE_TASK, "clients": ready})

    def _worker_exited(self, worker: str, code: int | None) -> bool:
        """``worker``'s process ended: each of its clients is dead (True), or it is no worker of this job (False)."""
        clients = self.workers.get(worker)
        if clients is None:
            return False
        with self._lock:
            self._seen_workers.discard(worker)  # a new process of it makes its clients ready again
        how = "exited" if code is None else f"exited with code {code}"
        dead = sum(self._mark_dead(site, f"its worker {worker} {how}", quiet=True) for site in clients)
        if dead:  # one line for them all: a worker may run thousands
            log.warning("worker dead worker=%s clients=%d reason=%s", worker, dead, how)
            self.report("worker_dead", site=worker, reason=how, clients=dead)
        return True

    def _stand_ins(self, connected: set[str]) -> set[str]:
        """The virtual clients whose worker is among the ``connected`` sites: alive, though they have no cell now."""
        return {client for worker in connected & self.workers.keys() for client in self.workers[worker]}

    def _told_targets(self, targets: list[str], connected: set[str]) -> list[str]:
        """Whom to tell of a task for ``targets``: a connected target itself, else its worker (once)."""
        worker_of = self._worker_of()
        told: dict[str, None] = {}
        for site in targets:
            if site in connected:
                told[site] = None
            elif site in worker_of and worker_of[site] in connected:
                told[worker_of[site]] = None
        return list(told)
