"""Checks of a recipe's arguments, each raising `TypeError` or `ValueError` that names the argument."""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.config.schema import check_document, load_schema
from engine.config.source import ConfigDocument
from engine.recipes.hocon import check_config_value

_COMPONENT_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_DOTTED_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
#: Top-level keys a recipe writes itself; the others (streaming, cell) come from add_*_config.
STRUCTURE_KEYS = frozenset(
    {"format_version", "workflows", "executors", "components", "task_data_filters", "task_result_filters"}
)


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` when it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return value


def number(
    name: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False
) -> float:
    """``value`` when it is a real number (not a bool) in the range given; the message names the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{name}: expected a number in {left}{low:g}, {high:g}{right}, got {value!r}")
    return value


def boolean(name: str, value: Any) -> bool:
    """``value`` when it is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r} ({type(value).__name__})")
    return value


def text(name: str, value: Any, *, allow_empty: bool = False) -> str:
    """``value`` when it is a string a config can carry (non-empty unless ``allow_empty``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a string, got {value!r} ({type(value).__name__})")
    if not value and not allow_empty:
        raise ValueError(f"{name}: expected a non-empty string")
    check_config_value(value, name)
    return value


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` when it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def dotted_path(name: str, value: Any) -> str:
    """``value`` when it is a dotted path ``module.Class``."""
    if not isinstance(value, str) or not _DOTTED_PATH.fullmatch(value):
        raise ValueError(
            f"{name}: expected a dotted path module.Class (e.g. 'engine.aggregators.DXOAggregator'), got {value!r}"
        )
    return value


def component_id(name: str, value: Any) -> str:
    """``value`` when it is a component id: letters, digits, ``_ . -``, starting with a letter or ``_``."""
    if not isinstance(value, str) or not _COMPONENT_ID.fullmatch(value):
        raise ValueError(
            f"{name}: expected an id of letters, digits, '_', '.' and '-' starting with a letter or '_', got {value!r}"
        )
    return value


def config_dict(name: str, value: Any) -> dict[str, Any]:
    """A copy of ``value`` when it is a dict a config can carry (None gives {})."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a dict, got {type(value).__name__}")
    check_config_value(value, name)
    return _plain(value)


def site_names(name: str, value: Any) -> list[str] | None:
    """``value`` as a list of site names (None stays None)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a list of site names, e.g. ['site-1', 'site-2'], got {value!r}")
    return [text(f"{name}[{i}]", site) for i, site in enumerate(value)]


def task_names(name: str, value: Any) -> list[str]:
    """``value`` as a non-empty list of task names (``*`` matches every task)."""
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise TypeError(f"{name}: expected a non-empty list of task names, e.g. ['*'] or ['train'], got {value!r}")
    return [text(f"{name}[{i}]", task) for i, task in enumerate(value)]


def metric_ranges(name: str, value: Any) -> dict[str, list[float]] | None:
    """``value`` as ``{metric: [low, high]}`` with low <= high (None stays None)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a dict metric -> [low, high], e.g. {{'accuracy': [0, 1]}}, got {value!r}")
    check_config_value(dict(value), name)  # the metric names are keys in the config
    ranges = {}
    for metric, bounds in value.items():
        where = f"{name}[{metric!r}]"
        text(where, metric)
        if isinstance(bounds, str) or not isinstance(bounds, Sequence) or len(bounds) != 2:
            raise ValueError(f"{where}: expected [low, high], got {bounds!r}")
        low, high = (number(where, bound, low=-math.inf) for bound in bounds)
        if low > high:
            raise ValueError(f"{where}: low {low!r} is above high {high!r}")
        ranges[metric] = [low, high]
    return ranges


def component(name: str, value: Any) -> dict[str, Any]:
    """``value`` as ``{path, args}``: a dotted path alone, or a dict with ``path`` and optional ``args``."""
    if isinstance(value, str):
        return {"path": dotted_path(name, value), "args": {}}
    if not isinstance(value, Mapping) or set(value) - {"path", "args"} or "path" not in value:
        raise ValueError(
            f"{name}: expected a dotted path or {{'path': 'module.Class', 'args': {{...}}}}, got {value!r}"
        )
    return {
        "path": dotted_path(f"{name}['path']", value["path"]),
        "args": config_dict(f"{name}['args']", value.get("args")),
    }


def no_overlap(name: str, extra: Mapping[str, Any], owned: Mapping[str, str]) -> None:
    """Refuse a key of ``extra`` (raw args) that the recipe sets from one of its own arguments."""
    for key in extra:
        if key in owned:
            raise ValueError(f"{name}: {key!r} is set by the recipe; use its argument {owned[key]} instead")


def existing_file(name: str, value: Any) -> Path:
    """``value`` as a path when it names an existing file."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a file path, got {type(value).__name__}")
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{name}: no such file {str(path)!r}" + (" (it is a folder)" if path.is_dir() else ""))
    return path


def script_args(value: Any) -> str:
    """``train_args`` as the one string the executor splits: a string as given, a list quoted with `shlex.join`."""
    if isinstance(value, str):
        arguments = text("train_args", value, allow_empty=True)
    elif isinstance(value, Sequence) and all(isinstance(item, str) for item in value):
        arguments = shlex.join(value)
        text("train_args", arguments, allow_empty=True)
    else:
        raise TypeError(f"train_args: expected a string ('--epochs 2') or a list of strings, got {value!r}")
    try:
        shlex.split(arguments)
    except ValueError as e:
        raise ValueError(f"train_args: {arguments!r} cannot be split into arguments: {e}") from e
    return arguments


def top_level_settings(side: str, config: Any) -> dict[str, Any]:
    """``config`` when every key is a top-level setting of ``config_fed_<side>`` and the schema takes its value."""
    where = f"add_{side}_config"
    settings = config_dict(where, config)
    schema = f"config_fed_{side}"
    known = set(load_schema(schema)["properties"]) - STRUCTURE_KEYS
    for key in settings:
        if key in STRUCTURE_KEYS:
            raise ValueError(f"{where}: {key!r} is written by the recipe; use its arguments and add_* methods")
        if key not in known:
            raise ValueError(f"{where}: unknown key {key!r}; expected one of {', '.join(sorted(known))}")
    probe = {"format_version": 2, **settings}
    probe["workflows" if side == "server" else "executors"] = []
    document = ConfigDocument(Path(f"{schema}.conf"), f"{schema}.conf", probe)
    problems = [p for p in check_document(document, schema) if p.key_path and p.key_path[0] in settings]
    if problems:
        first = problems[0]
        key = ".".join(str(part) for part in first.key_path)
        raise ValueError(f"{where}: {key}: {first.message}" + (f" ({first.hint})" if first.hint else ""))
    return settings


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists and mappings as dicts (what a config reads back)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
