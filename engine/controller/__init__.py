"""The Controller API: tasks, the task queue, and the `Controller` base class of workflows."""
