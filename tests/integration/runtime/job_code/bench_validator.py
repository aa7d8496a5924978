"""A validate executor for cross-site evaluation tests: the mean of the received parameters.

``fail_site`` fails its ``fail_call``-th validation (1-based) with an error, as an evaluator
whose data or hardware let it down would.
"""

from __future__ import annotations

import threading

import torch

from engine.executors import Executor, ExecutorContext
from engine.model import FLModel, ReturnCode, Shareable, make_reply, model_from_shareable, shareable_from_model


class BenchValidator(Executor):
    def __init__(self, fail_site: str = "", fail_call: int = 1) -> None:
        self.fail_site = fail_site
        self.fail_call = fail_call
        self.calls = 0

    def initialize(self, context: ExecutorContext) -> None:
        self.site = context.site_name

    def execute(self, task_name: str, shareable: Shareable, abort_signal: threading.Event) -> Shareable:
        self.calls += 1
        if self.site == self.fail_site and self.calls == self.fail_call:
            reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
            reply.set_header("reason", f"injected validation failure on {self.site}")
            return reply
        params = model_from_shareable(shareable).params or {}
        tensors = [value.resolve() if hasattr(value, "resolve") else value for value in params.values()]
        values = torch.cat([torch.as_tensor(tensor).double().flatten() for tensor in tensors])
        reply = shareable_from_model(FLModel(metrics={"mean": values.mean().item()}))
        reply.set_return_code(ReturnCode.OK)
        return reply
