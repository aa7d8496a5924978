"""Building components from ``{id, path, args}`` entries, and checking them without building.

`check_component` is the dry build `flengine validate` runs: the dotted path imports, names
something callable, and the args bind to its signature (no unknown or missing ones, no obviously
wrong types). `build_component` runs the same checks, then builds nested ``{path, args}`` args
first and calls the constructor.

`is_engine_component` tells, without importing anything, whether a dotted path names one of
flengine's own components; any other path runs code that the job brings (`engine.config.trust`).
A path into one of flengine's packages must resolve to an object defined there: reaching through
a module's imports (``engine.paths.os.system``) is refused.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import re
import sys
import traceback
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.problems import KeyPath, Problem
from engine.config.signature import accepted_args
from engine.config.source import ConfigDocument, type_name
from engine.errors import ComponentBuildError, ConfigError, DottedPathError

_DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_NESTED_KEYS = {"path", "args"}
_JOB_CODE_HINT = "check the spelling; the job's own code goes in the app's custom/ folder"
_INSTALLED_CODE = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
_ENGINE = "engine"
_NOT_OWN_HINT = "a job may name engine classes or its own code in custom/"

#: flengine's packages of components: workflows, aggregators, persistors, executors, filters and metrics receivers.
#: Its other packages are not components: their functions build, start or read whatever their
#: arguments name (``engine.config.build.build_component`` builds any dotted path at all).
ENGINE_COMPONENT_PACKAGES = (
    "engine.workflows",
    "engine.aggregators",
    "engine.persistors",
    "engine.executors",
    "engine.filters",
    "engine.metrics",
    "engine.examples",
)
#: A component class's attribute naming the packages it needs that flengine installs only with an
#: extra, as {import name: extra}, e.g. ``{"tensorboard": "tensorboard"}``: one that is missing is
#: a problem of the config (`flengine validate`, job start) that names ``pip install flengine[extra]``.
REQUIRED_EXTRAS = "REQUIRED_EXTRAS"


@dataclass(frozen=True)
class ComponentSpec:
    """One component entry of a config file.

    Attributes:
        path: Dotted path of the class or factory, e.g. ``engine.workflows.FedAvg``.
        args: Keyword arguments for it, as written in the config.
        id: The entry's id, if it has one.
        key_path: Where the entry sits in its document, e.g. ``("workflows", 0)``.
    """

    path: str
    args: dict[str, Any] = field(default_factory=dict)
    id: str | None = None
    key_path: KeyPath = ()

    @classmethod
    def from_entry(cls, entry: dict[str, Any], key_path: KeyPath) -> ComponentSpec:
        """Make a spec from a schema-valid ``{id, path, args}`` entry found at ``key_path``."""
        return cls(entry["path"], dict(entry.get("args", {})), entry.get("id"), key_path)


def is_nested_component(value: Any) -> bool:
    """Tell whether an arg value is a ``{path, args}`` object to be built before it is passed."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("path"), str)
        and _DOTTED_PATH.match(value["path"]) is not None
        and set(value) <= _NESTED_KEYS
    )


def is_engine_component(path: str) -> bool:
    """Tell, without importing it, whether a dotted path names one of flengine's own components.

    It does when it lies in one of `ENGINE_COMPONENT_PACKAGES` and every part is a public ASCII
    name (no ``_private`` or ``__dunder__`` one). Anything else is code the job brings: its own
    (``net.Net`` from custom/), the standard library's (``os.system``), or flengine's machinery
    (``engine.config.build.build_component``). `resolve_dotted_path` then makes sure such a path
    does not reach past its package (``engine.persistors.pt_file.shutil.rmtree`` is refused).

    Example::

        is_engine_component("engine.workflows.FedAvg")  # True
        is_engine_component("engine.paths.os.system")  # False
    """
    parts = path.split(".")
    public = all(part.isascii() and part.isidentifier() and not part.startswith("_") for part in parts)
    return public and _within(path, ENGINE_COMPONENT_PACKAGES)


def component_paths(spec: ComponentSpec) -> Iterator[tuple[KeyPath, str]]:
    """Yield ``(key path of a path, the dotted path)`` for ``spec`` and every component building it builds.

    Nested ``{path, args}`` args are followed as `build_component` follows them, through lists
    and the args of nested components.
    """
    yield spec.key_path + ("path",), spec.path
    for name, value in spec.args.items():
        for sub_path, nested in _nested_specs(value, spec.key_path + ("args", name)):
            if isinstance(nested.get("args", {}), dict):
                yield from component_paths(ComponentSpec.from_entry(nested, sub_path))
            else:
                yield sub_path + ("path",), nested["path"]


def check_component(spec: ComponentSpec, document: ConfigDocument) -> list[Problem]:
    """Dry-build ``spec``: return every problem building it would hit, without calling it."""
    try:
        target = resolve_dotted_path(spec.path)
    except DottedPathError as e:
        return [document.problem(spec.key_path + ("path",), e.message, e.hint)]
    if not callable(target):
        message = f"{spec.path!r} is {type_name(target)}, not a class or function"
        return [document.problem(spec.key_path + ("path",), message, "point `path` at a class or factory function")]

    problems = _check_signature(spec, target, document) + _missing_extras(spec, target, document)
    for name, value in spec.args.items():
        for sub_path, nested in _nested_specs(value, spec.key_path + ("args", name)):
            problems.extend(check_component(ComponentSpec.from_entry(nested, sub_path), document))
    return problems


def _missing_extras(spec: ComponentSpec, target: Any, document: ConfigDocument) -> list[Problem]:
    """One problem per package in the target's `REQUIRED_EXTRAS` that is not installed."""
    needed = getattr(target, REQUIRED_EXTRAS, None)
    if not isinstance(needed, dict):
        return []
    return [
        document.problem(
            spec.key_path + ("path",),
            f"{spec.path} needs the {module!r} package, which is not installed",
            f"pip install flengine[{extra}]",
        )
        for module, extra in needed.items()
        if isinstance(module, str) and module.isidentifier() and importlib.util.find_spec(module) is None
    ]


def build_component(spec: ComponentSpec, document: ConfigDocument) -> Any:
    """Build ``spec``: nested ``{path, args}`` args first, then the component itself.

    Raises:
        ConfigError: The dry checks found problems (all of them are listed).
        ComponentBuildError: The constructor raised; the original exception is chained.
    """
    problems = check_component(spec, document)
    if problems:
        raise ConfigError(problems)
    return _construct(spec, document)


def resolve_dotted_path(path: str) -> Any:
    """Import ``module.attr[.attr...]`` and return the object it names.

    A path into flengine (``engine.``) must name an object defined in flengine, and one into its
    components (`is_engine_component`) an object defined among them: a module's imports do not
    count (``engine.paths.os.system`` is ``os.system``, not flengine's).

    Raises:
        DottedPathError: The message says whether the module or the attribute is missing, what
            importing the module raised, or that the object is not flengine's own.
    """
    parts = path.split(".")
    if len(parts) < 2:
        raise DottedPathError(f"{path!r} is not a dotted path", "write module.Class, e.g. model.Net")
    missing_module = None
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                missing_module = missing_module or module_name
                continue
            raise _import_failed(module_name, e) from e
        except Exception as e:  # noqa: BLE001 - any error in the user's module is reported, not raised
            raise _import_failed(module_name, e) from e
        target = _get_attributes(module, module_name, parts[split:], missing_module)
        if parts[0] == _ENGINE:
            _check_engine_own(path, target)
        return target
    raise DottedPathError(f"cannot import {path!r}: no module named {parts[0]!r}", _JOB_CODE_HINT)


def _check_engine_own(path: str, target: Any) -> None:
    """Refuse a path into flengine that reaches an object defined elsewhere (or, for a component, outside them)."""
    component = is_engine_component(path)
    home = target.__name__ if inspect.ismodule(target) else getattr(target, "__module__", None)
    if isinstance(home, str) and _within(home, ENGINE_COMPONENT_PACKAGES if component else (_ENGINE,), exact=True):
        return
    name = getattr(target, "__qualname__", None)
    if inspect.ismodule(target):
        origin = f"the module {home}"
    elif isinstance(home, str) and isinstance(name, str):
        origin = f"{home}.{name}"
    else:
        origin = f"a {type(target).__name__} object"
    kind = "flengine's own component" if component else "flengine's own"
    raise DottedPathError(f"{path!r} is not {kind}: it is {origin}", _NOT_OWN_HINT)


def _within(name: str, packages: tuple[str, ...], *, exact: bool = False) -> bool:
    """Whether dotted ``name`` lies inside one of ``packages`` (or is one, with ``exact``)."""
    return any(name.startswith(package + ".") or (exact and name == package) for package in packages)


def _get_attributes(module: Any, module_name: str, names: list[str], missing_module: str | None) -> Any:
    target, owner = module, module_name
    for name in names:
        if not hasattr(target, name):
            if missing_module == f"{owner}.{name}":
                message = f"cannot import {missing_module!r}: no module named {missing_module!r}"
                raise DottedPathError(message, _JOB_CODE_HINT)
            public = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(name, public, n=1)
            hint = f"did you mean {close[0]!r}?" if close else None
            raise DottedPathError(f"cannot import '{owner}.{name}': {owner!r} has no attribute {name!r}", hint)
        target, owner = getattr(target, name), f"{owner}.{name}"
    return target


def _import_failed(module_name: str, error: BaseException) -> DottedPathError:
    text = error.msg if isinstance(error, SyntaxError) else str(error)  # str() repeats file and line
    return DottedPathError(f"importing {module_name!r} failed{_where_raised(error)}: {type(error).__name__}: {text}")


def _where_raised(error: BaseException) -> str:
    """Point at the job's own line that failed, not at importlib's or a library's frames."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" at {Path(error.filename).name}:{error.lineno}"
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not f.filename.startswith(_INSTALLED_CODE) and not f.filename.startswith("<")]
    frame = (own or frames or [None])[-1]
    return f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""


def _check_signature(spec: ComponentSpec, target: Any, document: ConfigDocument) -> list[Problem]:
    """Check the args against what the target accepts (a ``**kwargs`` followed to the parent's args)."""
    found = accepted_args(target)
    if found is None:
        return []  # some builtins have no signature; the constructor will check its own args
    params, hints, takes_any = found.parameters, found.hints, found.takes_any
    named = list(params)
    args_path = spec.key_path + ("args",)
    accepted = ", ".join(named) or "none"

    problems = []
    for name, value in spec.args.items():
        if name not in params:
            if not takes_any:
                close = difflib.get_close_matches(name, named, n=1)
                hint = f"did you mean {close[0]!r}? accepted: {accepted}" if close else f"accepted: {accepted}"
                problems.append(document.problem(args_path + (name,), f"unknown arg {name!r} for {spec.path}", hint))
            continue
        if name in hints:
            expected = _mismatch(value, hints[name])
            if expected:
                problems.append(document.problem(args_path + (name,), f"expected {expected}, got {_show(value)}"))
    for name in named:
        if params[name].default is inspect.Parameter.empty and name not in spec.args:
            problems.append(document.problem(args_path + (name,), f"missing required arg {name!r} for {spec.path}"))
    return problems


def _mismatch(value: Any, annotation: Any) -> str | None:
    """Return what was expected when ``value`` plainly does not fit ``annotation``, else None."""
    if is_nested_component(value):
        return None  # built into an object later; its own check covers it
    verdict = _fits(value, annotation)
    return _describe_annotation(annotation) if verdict is False else None


def _fits(value: Any, annotation: Any) -> bool | None:
    """True/False when the fit is clear, None when the annotation is too rich to judge."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        verdicts = [_fits(value, arg) for arg in typing.get_args(annotation)]
        return True if True in verdicts else (None if None in verdicts else False)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    plain = origin or annotation
    checks = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        list: lambda v: isinstance(v, list),
        tuple: lambda v: isinstance(v, list),
        dict: lambda v: isinstance(v, dict),
    }
    check = checks.get(plain)
    return check(value) if check else None


def _describe_annotation(annotation: Any) -> str:
    words = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        tuple: "a list",
        dict: "an object",
        type(None): "null",
    }
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_annotation(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return "one of " + ", ".join(_show(arg) for arg in typing.get_args(annotation))
    return words.get(origin or annotation, getattr(annotation, "__name__", str(annotation)))


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _nested_specs(value: Any, key_path: KeyPath) -> list[tuple[KeyPath, dict[str, Any]]]:
    if is_nested_component(value):
        return [(key_path, value)]
    if isinstance(value, list):
        return [found for i, item in enumerate(value) for found in _nested_specs(item, key_path + (i,))]
    return []


def _construct(spec: ComponentSpec, document: ConfigDocument) -> Any:
    args = {name: _build_value(value, spec.key_path + ("args", name), document) for name, value in spec.args.items()}
    try:
        return resolve_dotted_path(spec.path)(**args)
    except Exception as e:
        where = document.problem(spec.key_path, f"building {spec.path} failed: {type(e).__name__}: {e}")
        raise ComponentBuildError(str(where)) from e


def _build_value(value: Any, key_path: KeyPath, document: ConfigDocument) -> Any:
    if is_nested_component(value):
        return _construct(ComponentSpec.from_entry(value, key_path), document)
    if isinstance(value, list):
        return [_build_value(item, key_path + (i,), document) for i, item in enumerate(value)]
    return value
