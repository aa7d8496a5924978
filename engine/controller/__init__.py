"""The Controller API: tasks, the task queue, and the `Controller` base class of workflows."""

from engine.controller.context import JobContext
from engine.controller.controller import Controller
from engine.controller.queue import SubmitOutcome, TaskAssignment, TaskQueue
from engine.controller.task import ClientTask, SendOrder, Task, TaskCompletionStatus

__all__ = [
    "ClientTask",
    "Controller",
    "JobContext",
    "SendOrder",
    "SubmitOutcome",
    "Task",
    "TaskAssignment",
    "TaskCompletionStatus",
    "TaskQueue",
]
