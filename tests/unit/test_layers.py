"""The layers of DESIGN.md: a package imports only the packages below it (checked on the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine"

# What each top-level part of `engine` may import besides itself. A new package must be added
# here, with the arrows it needs, before its tests pass.
ALLOWED = {
    "errors": set(),
    "text": set(),
    "fault_points": set(),  # where the fault suite kills a process at a precise moment
    "metric_ranges": set(),  # the ranges metrics have by definition (checks and validate)
    "examples": {"client", "model"},  # the example jobs' data, model and training script (Client API)
    "paths": {"errors"},
    "config": {"errors", "metric_ranges"},
    "fobs": {"errors"},
    "cells": {"errors"},
    "streaming": {"errors", "fobs", "cells", "fault_points"},
    "security": {"errors", "cells"},
    "site": {"errors", "paths", "fobs", "cells", "security", "streaming"},
    "model": {"errors", "fobs"},
    "controller": {"errors", "model"},
    "aggregators": {"errors", "fobs", "model", "metric_ranges"},
    "persistors": {"errors", "paths", "fobs", "model"},
    "filters": {"errors", "fobs", "model"},
    "metrics": {"errors", "paths", "cells", "aggregators"},
    "workflows": {"errors", "paths", "model", "controller", "aggregators", "persistors", "filters", "fault_points"},
    "client": {"errors", "fobs", "cells", "streaming", "site", "model"},
    "executors": {
        "errors",
        "text",
        "paths",
        "fobs",
        "cells",
        "streaming",
        "site",
        "model",
        "client",
        "aggregators",
        "persistors",
        "fault_points",
    },  # fmt: skip
    "runtime": {
        "errors",
        "fault_points",
        "text",
        "paths",
        "config",
        "fobs",
        "cells",
        "security",
        "site",
        "streaming",
        "model",
        "controller",
        "executors",
        "client",
        "filters",
        "metrics",
    },
    "provision": {"errors", "config", "cells", "security"},
    "deploy": {
        "errors",
        "text",
        "paths",
        "config",
        "cells",
        "security",
        "site",
        "streaming",
        "provision",
        "runtime",
        "fobs",
        "model",
    },
    # Reads a finished run's workspace (the file names runtime writes); nothing below imports it.
    "report": {"errors", "text", "runtime"},
    # Jobs written in Python: they write job folders (config) and run them (runtime's simulator).
    "recipes": {"errors", "config", "runtime"},
    "cli": {
        "errors",
        "text",
        "config",
        "fobs",
        "cells",
        "streaming",
        "model",
        "runtime",
        "provision",
        "deploy",
        "report",
    },
    "__main__": {"cli"},
    # Data for `flengine new` (read by engine.config.new_job as package resources): no code.
    "templates": set(),
}


def part_of(path: Path) -> str:
    relative = path.relative_to(ENGINE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def engine_imports(path: Path) -> set[str]:
    """Parts of `engine` a module imports at run time (``if TYPE_CHECKING:`` blocks are skipped)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "engine":  # from engine import fobs
                names |= {f"engine.{alias.name}" for alias in node.names if alias.name in PARTS}
    return {name.split(".")[1] for name in names if name.startswith("engine.")}


PARTS = {p.stem if p.is_file() else p.name for p in ENGINE.iterdir() if p.suffix == ".py" or p.is_dir()}
MODULES = sorted(p for p in ENGINE.rglob("*.py") if p.name != "__init__.py" or p.parent != ENGINE)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ENGINE)))
def test_module_imports_only_lower_layers(path: Path) -> None:
    part = part_of(path)
    assert part in ALLOWED, f"engine/{part} is not in the layer table of {__file__}"

    upward = engine_imports(path) - ALLOWED[part] - {part}

    assert not upward, f"{path.relative_to(ENGINE)} imports higher layers: {sorted(upward)}"
