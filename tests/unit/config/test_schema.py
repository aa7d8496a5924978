"""The schemas themselves: documented keys, defaults, and the wording of their errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.config.schema import SCHEMA_NAMES, check_document, load_schema, top_level_defaults, with_defaults
from engine.config.source import ConfigDocument


def properties_of(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """Every (name, schema, required) property in a schema and its $defs, recursively."""
    found = []
    stack = [schema, *schema.get("$defs", {}).values()]
    while stack:
        node = stack.pop()
        required = set(node.get("required", []))
        for name, prop in node.get("properties", {}).items():
            found.append((name, prop, name in required))
            stack.append(prop)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                stack.append(node[key])
    return found


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_key_has_a_description_and_a_default(name: str) -> None:
    for key, prop, required in properties_of(load_schema(name)):
        if "$ref" in prop:
            continue  # documented where it is defined
        assert prop.get("description"), f"{name}: {key} has no description"
        if not required:
            documented = "default" in prop or "Default" in prop["description"]
            assert documented, f"{name}: optional key {key} documents no default"


@pytest.mark.parametrize("side", ["config_fed_server", "config_fed_client"])
def test_engine_settings_are_in_both_configs(side: str) -> None:
    defaults = top_level_defaults(side)

    assert defaults["tensor_download_chunk_size"] == 2097152
    assert defaults["np_download_chunk_size"] == 2097152
    assert defaults["streaming_per_request_timeout"] == 600


def test_with_defaults_fills_a_copy() -> None:
    data = {"format_version": 2, "tensor_download_chunk_size": 0}

    filled = with_defaults(data, "config_fed_client")

    assert filled["tensor_download_chunk_size"] == 0
    assert filled["np_download_chunk_size"] == 2097152
    assert filled["components"] == []
    assert data == {"format_version": 2, "tensor_download_chunk_size": 0}


def test_unknown_schema_name() -> None:
    with pytest.raises(ValueError, match=r"unknown schema 'nope'; expected one of common, meta"):
        load_schema("nope")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(
            {"format_version": 1},
            "c.conf: format_version: must be 2, got 1 (write `format_version = 2`)",
            id="format-version",
        ),
        pytest.param(
            {"format_version": 2, "np_download_chunk_size": 1.5},
            "c.conf: np_download_chunk_size: expected an integer, got 1.5 (bytes as a plain integer, e.g. 2097152 for 2 MiB; 0 sends arrays inline)",
            id="float-for-int",
        ),
        pytest.param(
            {"format_version": 2, "executors": []}, "c.conf: executors: needs at least 1 item, got 0", id="no-executors"
        ),
        pytest.param(
            {"format_version": 2, "executors": [{"tasks": [], "executor": {"path": "a.B"}}]},
            "c.conf: executors[0].tasks: needs at least 1 item, got 0",
            id="no-task-names",
        ),
        pytest.param(
            {"format_version": 2, "executors": [{"tasks": ["*"], "executor": {"path": "a.B", "args": [1]}}]},
            "c.conf: executors[0].executor.args: expected an object, got [1]",
            id="args-not-object",
        ),
        pytest.param(
            {"format_version": 2, "executors": [{"tasks": ["*"], "exec": {"path": "a.B"}}]},
            "c.conf: executors[0].executor: missing required key\n"
            "c.conf: executors[0].exec: unknown key 'exec' (did you mean 'executor'? accepted: executor, tasks)",
            id="unknown-nested-key",
        ),
    ],
)
def test_error_wording(data: dict[str, Any], expected: str) -> None:
    document = ConfigDocument(Path("c.conf"), "c.conf", data)
    data.setdefault("executors", [{"tasks": ["*"], "executor": {"path": "a.B"}}])

    problems = [str(p) for p in check_document(document, "config_fed_client")]

    assert problems == expected.split("\n")
