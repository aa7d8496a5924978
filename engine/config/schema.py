"""The JSON Schemas of config files (jobs, projects, site policies): loading them and checking documents.

The schemas live in the repository's top-level ``schemas/`` folder, installed as the package data
``engine.schemas``. Each jsonschema error becomes one `Problem` with a message written for the
person editing the file ("expected an integer, got \"2MB\"", "unknown key ... did you mean ...").
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError
from referencing import Registry, Resource

from engine.config.problems import Problem
from engine.config.source import ConfigDocument

SCHEMA_NAMES = ("common", "meta", "config_fed_server", "config_fed_client", "project", "site_policy")
_URN = "urn:flengine:schemas:"

_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "object": "an object",
    "array": "a list",
    "boolean": "true or false",
    "null": "null",
}

# Fixes for keys whose absence is common enough to deserve a concrete hint.
_MISSING_KEY_HINTS = {
    "format_version": "add `format_version = 2`",
    "path": "add `path = module.Class`, the dotted path of the class to build",
    "id": "add `id = some_name`, unique in this file",
    "workflows": "add `workflows = [{ id = ..., path = ..., args {...} }]`",
    "executors": 'add `executors = [{ tasks = ["*"], executor { path = ..., args {...} } }]`',
    "deploy_map": 'add `deploy_map { app = ["@ALL"] }`',
    "server": "add `server { host = fl.example.org, port = 8002, org = ... }`",
    "sites": "add `sites = [{ name = site-1, org = ... }]`",
    "admins": "add `admins = [{ name = ..., org = ..., role = project_admin }]`",
    "org": "add `org = ...`, the participant's organisation",
    "role": "add `role = ...`: project_admin, org_admin, lead or member",
}


def load_schema(name: str) -> dict[str, Any]:
    """Return the parsed JSON Schema ``name`` (one of `SCHEMA_NAMES`)."""
    if name not in SCHEMA_NAMES:
        raise ValueError(f"unknown schema {name!r}; expected one of {', '.join(SCHEMA_NAMES)}")
    return json.loads(_schema_text(name))


def check_document(document: ConfigDocument, schema_name: str) -> list[Problem]:
    """Check ``document`` against a schema and return every problem, in file order."""
    validator = _validator(schema_name)
    problems: list[Problem] = []
    for error in validator.iter_errors(document.data):
        problems.extend(_describe(error, document))
    return sorted(problems, key=lambda p: p.line or 0)


def with_defaults(data: dict[str, Any], schema_name: str) -> dict[str, Any]:
    """Return a copy of ``data`` with the schema's top-level defaults filled in."""
    result = copy.deepcopy(data)
    for key, default in top_level_defaults(schema_name).items():
        result.setdefault(key, copy.deepcopy(default))
    return result


@functools.cache
def top_level_defaults(schema_name: str) -> dict[str, Any]:
    """Map each top-level key of a schema that declares a default to that default."""
    defaults = {}
    for key in load_schema(schema_name).get("properties", {}):
        prop = _property_schema(schema_name, (key,))
        if prop is not None and "default" in prop:
            defaults[key] = prop["default"]
    return defaults


@functools.cache
def _schema_text(name: str) -> str:
    try:
        folder = resources.files("engine.schemas")
    except ModuleNotFoundError:
        # Running from a source checkout that is not installed editable: the schemas are the
        # repository's top-level folder, next to the package.
        folder = Path(__file__).resolve().parents[2] / "schemas"
    return folder.joinpath(f"{name}.schema.json").read_text(encoding="utf-8")


@functools.cache
def _registry() -> Registry:
    resources_by_urn = [(_URN + name, Resource.from_contents(load_schema(name))) for name in SCHEMA_NAMES]
    return Registry().with_resources(resources_by_urn)


@functools.cache
def _validator(schema_name: str) -> Draft202012Validator:
    return Draft202012Validator(load_schema(schema_name), registry=_registry())


def _resolve(schema: dict[str, Any], base_uri: str) -> tuple[dict[str, Any], str]:
    """Follow ``$ref`` until a schema without one; return it and the URI it came from."""
    while "$ref" in schema:
        resolved = _registry().resolver(base_uri=base_uri).lookup(schema["$ref"])
        schema = resolved.contents
        base_uri = resolved.resolver._base_uri  # noqa: SLF001 - referencing has no public accessor
    return schema, base_uri


def _property_schema(schema_name: str, key_path: tuple[str, ...]) -> dict[str, Any] | None:
    """Return the (resolved) schema of an object property path such as ``("format_version",)``."""
    schema, uri = _resolve(load_schema(schema_name), _URN + schema_name)
    for key in key_path:
        prop = schema.get("properties", {}).get(key)
        if prop is None:
            return None
        schema, uri = _resolve(prop, uri)
    return schema


def _describe(error: ValidationError, document: ConfigDocument) -> list[Problem]:
    path = tuple(error.absolute_path)
    kind = error.validator
    value = error.instance
    limit = error.validator_value
    if kind == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        return [
            document.problem(path + (key,), f"unknown key {key!r}", _unknown_key_hint(key, known))
            for key in value
            if key not in known
        ]
    if kind == "required":
        return [
            document.problem(path + (key,), "missing required key", _MISSING_KEY_HINTS.get(key))
            for key in limit
            if key not in value
        ]
    message = _MESSAGES.get(kind, lambda v, lim, p: error.message)(value, limit, path)
    # "x-hint" is our own annotation keyword in the schemas: how to write a valid value.
    return [document.problem(path, message, error.schema.get("x-hint"))]


def _unknown_key_hint(key: str, known: list[str]) -> str:
    if key == "name" and "path" in known:
        return "components are built from a dotted `path`; flengine does not look classes up by name"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    accepted = ", ".join(known)
    return f"did you mean {close[0]!r}? accepted: {accepted}" if close else f"accepted: {accepted}"


def _show(value: Any) -> str:
    """Show a value as the user wrote it: strings quoted, everything else as JSON."""
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _expected(types: str | list[str]) -> str:
    names = [types] if isinstance(types, str) else types
    return " or ".join(_TYPE_WORDS.get(t, t) for t in names)


_MESSAGES = {
    "type": lambda v, lim, p: f"expected {_expected(lim)}, got {_show(v)}",
    "minimum": lambda v, lim, p: f"must be >= {lim}, got {_show(v)}",
    "exclusiveMinimum": lambda v, lim, p: f"must be > {lim}, got {_show(v)}",
    "maximum": lambda v, lim, p: f"must be <= {lim}, got {_show(v)}",
    "exclusiveMaximum": lambda v, lim, p: f"must be < {lim}, got {_show(v)}",
    "const": lambda v, lim, p: f"must be {_show(lim)}, got {_show(v)}",
    "enum": lambda v, lim, p: f"must be one of {', '.join(_show(x) for x in lim)}, got {_show(v)}",
    "minItems": lambda v, lim, p: f"needs at least {lim} item{'s' if lim != 1 else ''}, got {len(v)}",
    "minProperties": lambda v, lim, p: f"needs at least {lim} entr{'ies' if lim != 1 else 'y'}, got none",
    "minLength": lambda v, lim, p: "must not be empty",
    "pattern": lambda v, lim, p: (
        f"{_show(v)} is not a dotted path" if p[-1:] == ("path",) else f"{_show(v)} is not a valid name"
    ),
}
