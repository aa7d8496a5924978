"""Executors: run a task on a client (`ClientAPIExecutor` runs a training script)."""
