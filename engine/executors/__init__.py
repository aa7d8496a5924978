"""Executors: run a task on a client (`ClientAPIExecutor` runs a training script)."""

from engine.executors.client_api import ClientAPIExecutor
from engine.executors.executor import Executor, ExecutorContext

__all__ = ["ClientAPIExecutor", "Executor", "ExecutorContext"]
