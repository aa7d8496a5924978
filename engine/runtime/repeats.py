"""`RepeatedRequests`: the server's answers to a client's task request or result asked again.

A client asks again when its request timed out or its connection dropped (see
`engine.cells.retry`), and it cannot know whether the server got the first one. So the server
must answer a repeat as it answered the first:

- a task request carries a ``request_id`` that the client keeps while it asks again: a repeat
  of the last one that was answered with a task gets that task again (while its result is still
  expected), never a second task, so a task whose answer was lost on the way is not lost with it;
- a result carries a ``request_id`` too: a repeat that comes while the first is still being
  received waits for it and gets its answer, and so does one that comes after it (the same
  outcome and ``held``), instead of pulling the result a second time. (A result sent twice on
  purpose, under two request ids, is a ``DUPLICATE`` as before.)

Every other request goes to the handler as before. One entry is kept per site.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from engine.cells import Message, Reply, Status
from engine.controller import SubmitOutcome
from engine.runtime import protocol

log = logging.getLogger(__name__)

Handler = Callable[[Message], Reply]


class RepeatedRequests:
    """Wraps the server's get-task and submit handlers so that a repeated request gets the first answer.

    Args:
        expects_result: ``expects_result(site, task_id)`` of the task queue: a task is sent again
            only while its result is still expected.
        submit_wait_s: Longest wait of a repeated result for the first one's answer, in seconds.

    Example:
        >>> repeats = RepeatedRequests(queue.expects_result, submit_wait_s=600.0)
        >>> cell.register_handler("task", "get", repeats.get_task(server.on_get_task))
    """

    def __init__(self, expects_result: Callable[[str, str], SubmitOutcome], submit_wait_s: float) -> None:
        self._expects_result = expects_result
        self._submit_wait_s = submit_wait_s
        self._lock = threading.Lock()
        self._get_locks: dict[str, threading.Lock] = {}  # site -> one task request at a time
        self._tasks: dict[str, tuple[str, str, Reply]] = {}  # site -> (request_id, task_id, reply)
        self._results: dict[str, tuple[str, Future[Reply]]] = {}  # site -> (request_id, its answer)

    def sites(self) -> set[str]:
        """The senders it keeps an entry for (one at most each)."""
        with self._lock:
            return set(self._get_locks) | set(self._tasks) | set(self._results)

    def forget(self, site: str) -> None:
        """Drop what is kept of ``site``'s answers (it died: its task ended, and a task reply may
        hold the model itself when tensors travel inline). A result still being received keeps
        its entry, so that a repeat of it still gets its answer."""
        with self._lock:
            self._tasks.pop(site, None)
            result = self._results.get(site)
            if result is not None and result[1].done():
                del self._results[site]

    def get_task(self, handler: Handler) -> Handler:
        """``handler`` for task requests, answering a repeat of the last task request with its task."""

        def answer(message: Message) -> Reply:
            site, request_id = message.source, message.header.get(protocol.HEADER_REQUEST_ID)
            if not isinstance(request_id, str):  # a client that never asks again
                return handler(message)
            with self._lock:
                site_lock = self._get_locks.setdefault(site, threading.Lock())
            with site_lock:  # a repeat that overtakes the first waits for it, not for a second task
                with self._lock:
                    last = self._tasks.get(site)
                if last is not None and last[0] == request_id:
                    task_id = last[1]
                    if self._expects_result(site, task_id) is SubmitOutcome.ACCEPTED:
                        log.info("task sent again site=%s task_id=%s (its first answer was lost)", site, task_id)
                        return last[2]
                reply = handler(message)
                header = reply.header or {}
                with self._lock:
                    if reply.status is Status.OK and header.get("state") == protocol.STATE_TASK:
                        self._tasks[site] = (request_id, str(header.get("task_id")), reply)
                    else:
                        self._tasks.pop(site, None)
                return reply

        return answer

    def submit(self, handler: Handler) -> Handler:
        """``handler`` for results, answering a repeat of a result (same request id) with the first one's answer."""

        def answer(message: Message) -> Reply:
            site, request_id = message.source, message.header.get(protocol.HEADER_REQUEST_ID)
            if not isinstance(request_id, str):  # a client that never sends a result again
                return handler(message)
            task_id = str(message.header.get("task_id", ""))
            with self._lock:
                last = self._results.get(site)
                first = last is None or last[0] != request_id
                if first:
                    future: Future[Reply] = Future()
                    self._results[site] = (request_id, future)
                else:
                    future = last[1]
            if not first:
                log.info("result received again site=%s task_id=%s: answered as the first", site, task_id)
                try:
                    return future.result(timeout=self._submit_wait_s)
                except FutureTimeout:
                    reason = f"the result of task {task_id} is still being received; the first one was not done "
                    reason += f"within {self._submit_wait_s:g} s"
                    return Reply(header={"outcome": "FAILED", "reason": reason}, status=Status.ERROR, reason=reason)
                except Exception as e:  # the first one's handler raised: so does this one
                    reason = f"the result of task {task_id} failed: {type(e).__name__}: {e}"
                    return Reply(header={"outcome": "FAILED", "reason": reason}, status=Status.ERROR, reason=reason)
            try:
                reply = handler(message)
            except BaseException as e:
                future.set_exception(e)
                raise
            future.set_result(reply)
            return reply

        return answer
