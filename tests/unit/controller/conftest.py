"""A queue of three clients on a fake clock, a bound workflow, and simulated clients in a thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from engine.controller import Controller, SubmitOutcome, TaskAssignment, TaskQueue
from engine.model import ReservedHeaderKey, ReturnCode, Shareable

CLIENTS = ["site-1", "site-2", "site-3"]


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Workflow(Controller):
    """A workflow whose `run` is driven by the test; it records the late results it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.late: list[tuple[str, str, str]] = []

    def run(self) -> None:
        """The tests call the Controller API directly."""

    def process_result_of_unknown_task(self, client: str, task_name: str, task_id: str, result: Shareable) -> None:
        self.late.append((client, task_name, task_id))


def make_result(code: ReturnCode = ReturnCode.OK, task_name: str = "train", **values: object) -> Shareable:
    """A client's result carrying ``code`` and ``values``."""
    result = Shareable(values)
    result.set_return_code(code)
    result.set_header(ReservedHeaderKey.TASK_NAME, task_name)
    return result


def answer(queue: TaskQueue, assignment: TaskAssignment, code: ReturnCode = ReturnCode.OK) -> SubmitOutcome:
    """Submit a result for ``assignment`` as its client."""
    result = make_result(code, assignment.task_name)
    return queue.submit(assignment.client_task.client, assignment.task_id, result)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(clock: FakeClock) -> TaskQueue:
    return TaskQueue(CLIENTS, clock=clock)


@pytest.fixture
def controller(queue: TaskQueue) -> Workflow:
    workflow = Workflow()
    workflow.bind(queue)
    return workflow


Reply = Callable[[str, TaskAssignment], Shareable]


class SimulatedClients:
    """Clients that pull tasks and answer them from a thread, as the runtime would relay them."""

    def __init__(self, queue: TaskQueue, names: Sequence[str], reply: Reply | None = None) -> None:
        self.queue = queue
        self.names = list(names)
        self.reply = reply or (lambda client, assignment: make_result(task_name=assignment.task_name))
        self.outcomes: list[tuple[str, SubmitOutcome]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="simulated-clients", daemon=True)

    def __enter__(self) -> SimulatedClients:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        assert not self._thread.is_alive(), "simulated clients did not stop"

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = False
            for name in self.names:
                assignment = self.queue.next_task(name)
                if assignment is not None:
                    busy = True
                    outcome = self.queue.submit(name, assignment.task_id, self.reply(name, assignment))
                    self.outcomes.append((name, outcome))
            if not busy:
                self._stop.wait(0.002)  # a real client waits `retry_s` after "try again later"


@pytest.fixture
def simulated_clients(queue: TaskQueue) -> Callable[..., SimulatedClients]:
    def make(names: Sequence[str] = CLIENTS, reply: Reply | None = None) -> SimulatedClients:
        return SimulatedClients(queue, names, reply)

    return make


@pytest.fixture
def run_in_thread() -> Iterator[Callable[[Callable[[], object]], threading.Thread]]:
    """Start ``fn`` in a thread; every thread must have ended when the test ends."""
    threads: list[threading.Thread] = []

    def start(fn: Callable[[], object]) -> threading.Thread:
        thread = threading.Thread(target=fn, daemon=True)
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.join(timeout=2.0)
        assert not thread.is_alive(), "a test thread did not end"
