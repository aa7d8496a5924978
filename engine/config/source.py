"""Reading one config file (HOCON ``.conf`` or ``.json``) into plain data that remembers its lines.

HOCON goes through pyhocon (includes, ``${...}`` substitutions, ``${?ENV}`` fallbacks); JSON goes
through the standard library. Either way the result is plain dicts, lists and scalars, plus a map
from key path to the line it was written on, so later checks can point at the exact line.

A job that a server or a site receives is read with ``environment=False``: a substitution the
file does not define is a problem, never answered from the process environment (see
`engine.config.substitutions`).
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyparsing
from pyhocon import ConfigFactory, ConfigTree
from pyhocon.exceptions import ConfigException, ConfigSubstitutionException

from engine.config.locate import find_includes, locate_keys
from engine.config.problems import KeyPath, Problem
from engine.config.substitutions import EnvironmentReference, environment_references, resolve
from engine.errors import ConfigError

CONFIG_SUFFIXES = (".conf", ".json")

_REMOTE_PREFIXES = ("http://", "https://", "file://")
_PYHOCON_LINE = re.compile(r"\(line: (\d+), col: \d+\)")


@dataclass
class ConfigDocument:
    """A parsed config file.

    Attributes:
        path: The file on disk.
        display: The file as shown in messages (relative to the folder the user named).
        data: The parsed content as plain dicts, lists and scalars.
        key_lines: 1-based line of each key path, where the file spells it out.
    """

    path: Path
    display: str
    data: dict[str, Any]
    key_lines: dict[KeyPath, int] = field(default_factory=dict)

    def line_of(self, key_path: KeyPath) -> int | None:
        """Return the line of ``key_path``, or of its nearest written ancestor."""
        for end in range(len(key_path), 0, -1):
            line = self.key_lines.get(key_path[:end])
            if line is not None:
                return line
        return None

    def problem(self, key_path: KeyPath, message: str, hint: str | None = None) -> Problem:
        """Make a `Problem` located at ``key_path`` of this file."""
        return Problem(self.display, self.line_of(key_path), key_path, message, hint)


def load_config(path: Path, display: str, root: Path, *, environment: bool = True) -> ConfigDocument:
    """Load one ``.conf`` or ``.json`` file of a job folder.

    Args:
        path: The file to read.
        display: How to name the file in messages.
        root: The job folder; an ``include`` that reaches outside it is refused.
        environment: Whether a ``${NAME}`` or ``${?NAME}`` that the file (with its includes)
            does not define may be read from the process environment, as HOCON does. False for
            a job sent to a server or a site: such a substitution is then a problem.

    Returns:
        The parsed document; its top level is always an object.

    Raises:
        ConfigError: The file cannot be read or parsed, an include is refused, a substitution
            would read the environment that may not, or the top level is not an object. Every
            problem found is listed.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([Problem(display, None, (), f"cannot read the file: {e}")]) from e

    key_lines = locate_keys(text)
    if path.suffix == ".json":
        data = _parse_json(text, display)
    else:
        files: dict[Path, str] = {}
        problems = list(_check_includes(path, display, root, seen=files))
        if problems:
            raise ConfigError(problems)
        data = _parse_hocon(ConfigDocument(path, display, {}, key_lines), environment, files)

    if not isinstance(data, dict):
        raise ConfigError([Problem(display, 1, (), f"the top level must be an object, got {type_name(data)}")])
    return ConfigDocument(path, display, data, key_lines)


def type_name(value: Any) -> str:
    """Name a parsed value's type the way config authors think of it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _parse_json(text: str, display: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        problem = Problem(display, e.lineno, (), f"invalid JSON: {e.msg} at column {e.colno}")
        raise ConfigError([problem]) from e


def _parse_hocon(file: ConfigDocument, environment: bool, files: dict[Path, str]) -> Any:
    """Parse and resolve ``file`` (its lines known, its data not yet); ``files``: those it includes."""
    display = file.display
    tree = _with_pyhocon(display, lambda: ConfigFactory.parse_file(str(file.path), required=True, resolve=False))
    if not environment:
        references = environment_references(tree)
        if references:
            raise ConfigError(_environment_problems(references, file, files))
    _with_pyhocon(display, lambda: resolve(tree, environment=environment))
    return _to_plain(tree)


#: pyhocon changes pyparsing's global whitespace settings while it parses, so two threads
#: parsing at once (two submits, or a submit while the scheduler loads a job) can misparse a
#: valid file: every pyhocon step runs under this lock.
_PYHOCON_LOCK = threading.Lock()


def _with_pyhocon(display: str, step: Callable[[], Any]) -> Any:
    """Run a pyhocon step (one at a time); turn what it raises into a `ConfigError` naming the file and line."""
    try:
        with _PYHOCON_LOCK:
            return step()
    except pyparsing.ParseBaseException as e:
        problem = Problem(display, e.lineno, (), f"syntax error: {e.msg} at column {e.col}")
        raise ConfigError([problem]) from e
    except ConfigSubstitutionException as e:
        match = _PYHOCON_LINE.search(str(e))
        line = int(match.group(1)) if match else None
        message = _PYHOCON_LINE.sub("", str(e)).strip().rstrip(".")
        hint = "define it, or write ${?NAME} to make it optional"
        raise ConfigError([Problem(display, line, (), message[:1].lower() + message[1:], hint)]) from e
    except (ConfigException, OSError) as e:
        raise ConfigError([Problem(display, None, (), f"cannot load HOCON: {e}")]) from e
    except (AttributeError, TypeError, ValueError, RecursionError) as e:
        # pyhocon trips over some odd inputs (`a.b += [1]`, a list that refers to itself)
        message = f"pyhocon cannot read this file: {type(e).__name__}: {e}"
        raise ConfigError([Problem(display, None, (), message, "simplify its substitutions")]) from e


def _environment_problems(
    references: list[EnvironmentReference], main: ConfigDocument, files: dict[Path, str]
) -> list[Problem]:
    """One problem per substitution that would read the environment, at its file and line.

    A substitution pyhocon keeps no text for (``+=``) is placed by its key in the main file.
    """
    displays = {}
    for file, file_display in files.items():
        try:  # as pyparsing reads it: line ends untouched, tabs expanded, so that offsets match
            displays[file.read_bytes().decode("utf-8").expandtabs()] = file_display
        except (OSError, UnicodeDecodeError):
            continue
    problems = []
    for reference in references:
        key_path = tuple(_unquote(k) if isinstance(k, str) else k for k in reference.key_path)
        file = displays.get(reference.source, main.display) if reference.source is not None else main.display
        line = reference.line if reference.source is not None else main.line_of(key_path)
        if reference.appends:
            message = f"appends to {reference.variable} with +=, which this file does not define before"
            hint = f"give {reference.variable} a value before, e.g. {reference.variable} = []"
        elif reference.null:
            message = (
                f"refers to {reference.written}, which this file sets to null (pyhocon then reads the environment)"
            )
            hint = "write the value itself"
        else:
            message = f"refers to {reference.written}, which this file does not define"
            hint = f"define {reference.variable} in the file, or write the value itself"
        message += "; a job sent to a server may not read its environment"
        problem = Problem(file, line, key_path, message, hint)
        if problem not in problems:
            problems.append(problem)
    return problems


def _to_plain(value: Any) -> Any:
    """Turn pyhocon's trees and lists into plain dicts and lists (durations become seconds)."""
    if isinstance(value, ConfigTree):
        return {_unquote(key): _to_plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_plain(item) for item in value]
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
        return int(seconds) if seconds.is_integer() else seconds
    return value


def _unquote(key: str) -> str:
    # pyhocon keeps the quotes of a quoted key that contains a dot ("a.b" = 1).
    if len(key) >= 2 and key[0] == key[-1] == '"':
        return key[1:-1]
    return key


def _check_includes(path: Path, display: str, root: Path, seen: dict[Path, str]) -> Iterator[Problem]:
    """Yield a problem for each include, in ``path`` or what it includes, that leaves ``root``.

    ``seen`` gathers every file read, by real path, with the name messages give it.
    """
    real = path.resolve()
    if real in seen:
        return
    seen[real] = display
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return  # pyhocon reports unreadable files itself
    root_real = root.resolve()
    for include in find_includes(text):
        where = (
            f"include {include.kind}({include.target!r})" if include.kind != "plain" else f"include {include.target!r}"
        )
        if include.kind in ("url", "classpath", "package") or include.target.startswith(_REMOTE_PREFIXES):
            yield Problem(display, include.line, (), f"{where}: only files inside the job folder may be included")
            continue
        pattern = os.path.normpath(os.path.join(path.parent, include.target))
        targets = [Path(p) for p in glob.glob(pattern, recursive=True)] or [Path(pattern)]
        outside = [t for t in targets if not _is_within(t, root_real)]
        if outside:
            yield Problem(
                display,
                include.line,
                (),
                f"{where} reaches outside the job folder {str(root)!r}",
                "copy the shared file into the job folder",
            )
            continue
        for target in targets:
            if target.is_file():
                target_display = os.path.normpath(os.path.join(os.path.dirname(display), include.target))
                yield from _check_includes(target, target_display, root, seen)


def _is_within(path: Path, root_real: Path) -> bool:
    try:
        path.resolve().relative_to(root_real)
    except ValueError:
        return False
    return True
