"""`ResultIntake`: how a job's server process takes a client's submitted result (part of `ServerJob`).

A submitted result is refused before a byte of it is pulled unless the task expects it; it may
announce at most `RESULT_SIZE_FACTOR` times the bytes of the model its task sent. In memory, a
whole result is pulled and aggregated one at a time (the server holds at most one client's model
beyond the sum); a result the workflow folds into its sum as its tensors arrive is pulled at once,
once the task's model is out of the server's hands (its receivers pulled it, or are not waited
for: ``fold_wait_s``), and is held on its sender until the round's mean is made, so that the sum
can be rebuilt without a result that failed midway (`_refold`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any

from engine.cells import Message, Reply, Status
from engine.controller import SubmitOutcome
from engine.errors import FlengineError, MalformedMessageError, StreamingError
from engine.model import ReturnCode, Shareable
from engine.model.payload import RESULT_SIZE_FACTOR, payload_bytes, result_limit
from engine.runtime.stalls import STALLED_AFTER
from engine.streaming.lazy import cleanup_lazy_refs
from engine.streaming.pull import HeldDownload, release_held

log = logging.getLogger("engine.runtime.server")  # the server job's log lines, named as before

#: A folded result waits for the task data's downloads to end (see `_on_submit`) at most until
#: they have had no request for this long (a client that died or got stuck mid-pull). Receivers
#: that never asked for a chunk are waited for ``fold_wait_s`` only (the server config's key,
#: `DEFAULT_FOLD_WAIT_S` by default), then dropped (see `StallWatch`).
FOLD_WAIT_IDLE_S = 10.0
#: And at most this long in all, whatever the receivers do.
FOLD_WAIT_LONGEST_S = 60.0


class ResultIntake:
    """The submit handler of `ServerJob` and what it uses; the attributes it reads are `ServerJob`'s."""

    def _on_submit(self, message: Message) -> Reply:
        """A client's result (its cell is one of the job's clients: see `_clients_only`)."""
        # In memory, a whole result is pulled and aggregated one at a time, so the server holds at
        # most one client's model beyond the sum (others wait for their turn); on disk, all at once.
        # A result the workflow folds into its sum as its tensors arrive (see `_receiver_of`)
        # never is whole: those are pulled at once.
        receiver = self._receiver_of(message)
        task_id = str(message.header.get("task_id", ""))
        with self._lock:
            # Only the task's own client says it is done with its data: another site may know the
            # id (the data sent to all holds the first client's), and would unhook its offers.
            owner, offers = self._task_offers.get(task_id, ("", []))
            if owner == message.source:
                del self._task_offers[task_id]
            else:
                offers = []
        if offers:  # the submitter is done with the task's data, whether it got all of it or not
            self.endpoint.service.drop_receiver(offers, message.source)
        if receiver is not None and offers:
            # Folding starts once every client has the model the task sent (its downloads end),
            # so the server never holds that model and a growing sum at once.
            # A receiver that has not asked for a chunk within ``fold_wait_s`` is not waited for
            # when the task can get the results it needs without it: it is dropped, so the model
            # is freed once those that pulled are done (one that is only slow is waited for).
            # However its receivers behave, the wait ends after FOLD_WAIT_LONGEST_S: one that keeps
            # asking without finishing would otherwise hold this handler thread (and the fold).
            idle_s = min(self.codec.context.per_request_timeout_s, FOLD_WAIT_IDLE_S)
            until_s = time.monotonic() + FOLD_WAIT_LONGEST_S
            service = self.endpoint.service
            skipped: set[str] = set()
            stop, longest_s = self.abort_signal, FOLD_WAIT_LONGEST_S
            if self.workers:  # virtual clients pull in turns: waiting for one whose turn is later would stall
                finished = service.wait_pulls_finished(offers, idle_s, stop, longest_s)
            elif not (finished := service.wait_finished(offers, min(idle_s, self._fold_wait_s), stop, longest_s)):
                unpulled = service.never_pulled(offers)
                skipped = unpulled if unpulled and self.queue.can_do_without(task_id, unpulled) else set()
                for site in skipped:
                    log.warning("task data not pulled site=%s waited_s=%g: not waited for", site, self._fold_wait_s)
                    service.drop_receiver(offers, site)
                finished = service.wait_finished(offers, idle_s, stop, max(0.0, until_s - time.monotonic()))
            if not finished and time.monotonic() >= until_s:
                log.warning(
                    "task data still being pulled after %g s site=%s: its result is folded now, while the "
                    "model may still be held",
                    FOLD_WAIT_LONGEST_S,
                    message.source,
                )
            for site in self._stalls.judged(offers, self.clients, skipped) if not self.workers else ():
                self.report("site_stalled", site=site, tasks_in_a_row=STALLED_AFTER)
        slot = self._memory_slot if not self.endpoint.receives_to_disk else None
        if receiver is None:
            with slot or contextlib.nullcontext():
                return self._take_result(message, receiver)
        taken: list[threading.Lock] = []  # a result the workflow takes whole waits for the slot too
        try:
            return self._take_result(message, receiver, slot, taken)
        finally:
            for lock in taken:
                lock.release()

    def _receiver_of(self, message: Message) -> Any:
        """The workflow's result receiver of this submit (folding, memory mode, no result filters), else None."""
        if self.endpoint.receives_to_disk or self._result_filters:
            return None
        return self.queue.result_receiver(message.source, str(message.header.get("task_id", "")))

    def _take_result(
        self,
        message: Message,
        receiver: Any = None,
        whole_slot: threading.Lock | None = None,
        taken: list[threading.Lock] | None = None,
    ) -> Reply:
        site = message.source
        task_id = str(message.header.get("task_id", ""))
        task_name = str(message.header.get("task_name", ""))
        expected = self.queue.expects_result(site, task_id)
        if expected is not SubmitOutcome.ACCEPTED:  # refused before a byte of it is pulled
            log.warning("result of %s for task %r not taken: %s", site, task_name, expected.value)
            return Reply(header={"outcome": expected.value})
        with self._lock:
            _, sent_bytes = self._sent_bytes.pop(task_id, (site, 0))
        self._downloads.ended(task_id)
        started = time.monotonic()
        self.report("result_uploading", site=site, task=task_name, task_id=task_id)
        result = None
        sinks: list[Any] = []  # the sink folding this result, once the receiver gave one
        # A folded result's downloads stay open on its sender until the round's mean is made: if
        # another result fails midway, the sum is rebuilt by pulling this one again (`refold`).
        held: list[HeldDownload] = []
        limit = result_limit(sent_bytes)
        what = f"a result of {site} (at most {RESULT_SIZE_FACTOR} x the {sent_bytes} bytes it was sent)"

        def fold(peeked: Any) -> Any:
            sink = receiver(peeked, site) if isinstance(peeked, Shareable) else None
            if sink is not None:
                sink.refold = functools.partial(self._refold, message.frames, site, limit, what)
                sink.release = functools.partial(release_held, self.cell, held)
                sinks.append(sink)
            elif whole_slot is not None and taken is not None:  # pulled whole: one at a time, as above
                whole_slot.acquire()
                taken.append(whole_slot)
            return sink

        try:
            folding = fold if receiver is not None else None
            result = self.codec.decode(
                message.frames,
                sender=site,
                max_bytes=limit,
                what=what,
                fold=folding,
                held=held if folding else None,
                stop=self.abort_signal,
            )
            if not isinstance(result, Shareable):
                raise MalformedMessageError(f"expected a Shareable, got {type(result).__name__}")
            result = self._result_filters.apply(task_name, result, site)
        except Exception as e:  # download failed, bad payload or a filter refused it: answered, never raised
            if isinstance(e, FlengineError):  # the site's or the network's doing
                reason = f"result of {site} for task {task_name!r} refused: {e}"
                log.warning("%s", reason)
            else:  # not the site's doing: a bug on the server, e.g. in a check of the workflow (which records it)
                reason = f"result of {site} for task {task_name!r} failed on the server: {type(e).__name__}: {e}"
                log.error("%s", reason, exc_info=True)
            cleanup_lazy_refs(result)
            for sink in sinks:
                sink.fail(reason)
            release_held(self.cell, held)
            self.queue.fail_client_task(site, task_id, reason)
            return Reply(header={"outcome": "FAILED", "reason": reason}, status=Status.ERROR, reason=reason)
        seconds = time.monotonic() - started
        self.report(
            "result_received",
            site=site,
            task=task_name,
            task_id=task_id,
            bytes=payload_bytes(result),
            seconds=seconds,
            ok=result.get_return_code() is ReturnCode.OK,
        )
        outcome = self.queue.submit(site, task_id, result)
        if outcome is not SubmitOutcome.ACCEPTED:  # late or duplicate: nobody will read its files
            cleanup_lazy_refs(result)
        for sink in sinks:  # committed by the workflow if it took the result; a no-op then
            sink.fail(f"result of {site} not taken by the task: {outcome.value}")
        if not any(sink.release is not None and sink.failed is None for sink in sinks):
            release_held(self.cell, held)  # not folded, or not taken: nothing will pull it again
            held = []
        # A held result: its sender keeps serving it until the round's mean is made (the
        # workflow's aggregator releases it), or until its next task.
        return Reply(header={"outcome": outcome.value, "held": bool(held)})

    def _refold(self, frames: list[Any], site: str, limit: int, what: str, sink: Any) -> None:
        """Pull a folded result of ``site`` once more, into ``sink`` (a rebuild of the round's sum).

        The pull ends at once when ``sink`` fails (past the rebuild's time for it, or the job stopping).

        Raises:
            StreamingError: ``site`` is dead (its process ended): nothing to pull, no time spent waiting.
        """
        why = self.liveness.dead().get(site)
        if why is not None:
            raise StreamingError(f"{site} is dead ({why}): its result cannot be pulled again")
        decoded = self.codec.decode(
            frames, sender=site, max_bytes=limit, what=what, fold=lambda peeked: sink, held=[], stop=sink.ended
        )
        del decoded  # its tensors went to the sink; only meta tensors are left
