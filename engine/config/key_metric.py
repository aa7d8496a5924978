"""The check that a config's ``key_metric`` has a range: a best model no single site can pick.

The persistor keeps as ``best_global`` the model whose round metric ``key_metric`` is highest. That
value is the sites' weighted mean, and a site with a valid key reports what it likes: without a
bound, one site reporting 1e9 picks the best model alone. So a ``key_metric`` set in a config must
have a range in the same config's ``metric_ranges`` (or a default one, see
`engine.metric_ranges.default_metric_range`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.config.problems import KeyPath, Problem
from engine.config.source import ConfigDocument
from engine.metric_ranges import default_metric_range

#: Args that declare metric ranges (workflows, aggregation clients, cross-site evaluation).
RANGE_ARGS = ("metric_ranges", "eval_metric_ranges")


def check_key_metric_ranges(document: ConfigDocument) -> list[Problem]:
    """One problem per ``key_metric`` arg of ``document`` that has neither a declared nor a default range."""
    declared: set[str] = set()
    key_metrics: list[tuple[KeyPath, str]] = []
    for path, args in _args_of(document.data):
        for name in RANGE_ARGS:
            if isinstance(args.get(name), dict):
                declared.update(str(metric) for metric in args[name])
        if isinstance(args.get("key_metric"), str):
            key_metrics.append(((*path, "args", "key_metric"), args["key_metric"]))
    problems = []
    for key_path, metric in key_metrics:
        if metric in declared or default_metric_range(metric) is not None:
            continue
        problems.append(
            document.problem(
                key_path,
                f"key_metric {metric!r} has no range: one site reporting a huge value would pick the best model",
                f"declare it in the workflow's args, e.g. `metric_ranges {{ {metric} = [low, high] }}`",
            )
        )
    return problems


def _args_of(data: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, dict[str, Any]]]:
    """Every ``args`` dict of the config, with the key path of the entry that holds it."""
    if isinstance(data, dict):
        if isinstance(data.get("args"), dict):
            yield path, data["args"]
        for key, value in data.items():
            yield from _args_of(value, (*path, key))
    elif isinstance(data, list):
        for i, item in enumerate(data):
            yield from _args_of(item, (*path, i))
