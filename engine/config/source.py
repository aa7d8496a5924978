"""Reading one config file (HOCON ``.conf`` or ``.json``) into plain data that remembers its lines.

Config files are hostile input (a job arrives from another organisation), so reading one never
hangs, recurses without bound, or lets out an exception other than `ConfigError`; every limit
is a constant of `engine.config.limits`:

- the file must be a regular file of at most `MAX_CONFIG_FILE_BYTES`, in UTF-8
  (`read_config_text`);
- `engine.config.scan` measures it (nesting, number of values) and reads a *plain* HOCON file
  itself, with its key lines, about a thousand times faster than pyhocon;
- JSON goes through the standard library, its lines mapped by the same scan;
- anything else in HOCON (includes, ``${...}`` substitutions, ``${?ENV}`` fallbacks, ``+=``,
  durations, ...) goes through pyhocon, once `engine.config.includes` has checked every include
  (one existing file inside the job folder, named literally; a missing one is a problem, plain
  or ``required``), once `MAX_FULL_HOCON_TOKENS` says pyhocon will not take long, and once
  `expanded_size` says the substitutions will not blow up;
- a number too large for a float (``1e999999``, 5000 digits) is a problem at its key.

Either way the result is plain dicts, lists and scalars, plus a map from key path to the line it
was written on, so later checks can point at the exact line.

A job that a server or a site receives is read with ``environment=False``: a substitution the
file does not define is a problem, never answered from the process environment (see
`engine.config.substitutions`).
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyparsing
from pyhocon import ConfigFactory, ConfigTree, period_parser
from pyhocon.config_tree import NoneValue
from pyhocon.exceptions import ConfigException, ConfigSubstitutionException

from engine.config.includes import check_includes
from engine.config.limits import MAX_CONFIG_VALUES, MAX_FULL_HOCON_TOKENS, MAX_NESTING_DEPTH, read_config_text
from engine.config.locate import locate_keys, without_includes
from engine.config.problems import KeyPath, Problem
from engine.config.scan import ConfigScan, scan_config
from engine.config.substitutions import EnvironmentReference, environment_references, expanded_size, resolve
from engine.errors import ConfigError, FlengineError, IncludeRefused

# pyhocon reads a duration as dateutil's relativedelta when python-dateutil is installed (the
# `report` extra's matplotlib brings it) and as a timedelta otherwise, and only with dateutil
# does it know months and years, which have no fixed length in seconds. A config must mean the
# same on every site, whatever else is installed there: durations are always timedeltas.
period_parser.period_impl = datetime.timedelta
for _unit in ("months", "years"):
    period_parser.period_type_map.pop(_unit, None)

CONFIG_SUFFIXES = (".conf", ".json")

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
        ConfigError: The file cannot be read or parsed, is over a limit of
            `engine.config.limits`, an include is refused, a substitution would read the
            environment that may not, a number is too large, or the top level is not an object.
            Every problem found is listed.
    """
    text = read_config_text(path, display)
    if path.suffix == ".json":
        scan = scan_config(text, display, json_file=True)
        data = _parse_json(text, display)
        key_lines = scan.key_lines if scan.key_lines is not None else locate_keys(text)
    else:
        data, key_lines = _read_hocon(path, display, text, root, environment)

    if not isinstance(data, dict):
        raise ConfigError([Problem(display, 1, (), f"the top level must be an object, got {type_name(data)}")])
    document = ConfigDocument(path, display, data, key_lines)
    problems = _number_problems(document)
    if problems:
        raise ConfigError(problems)
    return document


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
        return _loads_json(text)
    except json.JSONDecodeError as e:
        problem = Problem(display, e.lineno, (), f"invalid JSON: {e.msg} at column {e.colno}")
        raise ConfigError([problem]) from e
    except RecursionError as e:  # `scan_config` stops deep nesting first; this is the backstop
        message = f"objects and lists nest more than {MAX_NESTING_DEPTH} levels deep"
        raise ConfigError([Problem(display, None, (), message, "flatten it")]) from e


def _loads_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer past Python's digit limit: read it as too large, and say where
        # The second reading can still fail past that integer (text after it): its
        # JSONDecodeError is then the file's problem, as for any other syntax error.
        return json.loads(text, parse_int=_int_or_infinite)


def _int_or_infinite(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return math.inf  # `_number_problems` reports it at its key


def _number_problems(document: ConfigDocument) -> list[Problem]:
    """A problem for each number that did not fit a float (read as infinity) or is NaN."""
    problems = []
    pending: list[tuple[KeyPath, Any]] = [((), document.data)]
    while pending:
        key_path, value = pending.pop()
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            # one sum tells whether a long list of numbers holds an infinity or a NaN
            if math.isfinite(sum(item for item in value if type(item) is float)):
                pending.extend(((*key_path, i), item) for i, item in enumerate(value) if isinstance(item, (dict, list)))
                continue
            items = enumerate(value)
        else:
            continue
        for key, item in items:
            if isinstance(item, (dict, list)):
                pending.append(((*key_path, key), item))
            elif type(item) is float and not math.isfinite(item):
                problems.append(_number_problem(document, (*key_path, key), item))
    return sorted(problems, key=lambda p: p.line or 0)


def _number_problem(document: ConfigDocument, key_path: KeyPath, value: float) -> Problem:
    if math.isnan(value):
        return document.problem(key_path, "NaN is not allowed in a config", "write a number, or null")
    message = "the number is too large: beyond 1.8e308, or longer than 4300 digits"
    return document.problem(key_path, message, "write a smaller number, or quote it to keep it as text")


def _read_hocon(path: Path, display: str, text: str, root: Path, environment: bool) -> tuple[Any, dict[KeyPath, int]]:
    """A HOCON text's data and key lines: read by the scan when it is plain, else by pyhocon."""
    scan = scan_config(text, display)
    if scan.data is not None and scan.key_lines is not None:
        return scan.data, scan.key_lines
    return _parse_hocon(path, display, text, scan, root, environment)


def _parse_hocon(
    path: Path, display: str, text: str, scan: ConfigScan, root: Path, environment: bool
) -> tuple[Any, dict[KeyPath, int]]:
    """Check the includes and the size of a HOCON text that is not plain, then parse and resolve it with pyhocon."""
    includes = check_includes(path, display, text, scan, root)
    if includes.problems:
        raise IncludeRefused(includes.problems, _without_includes(path, display, text, root, environment))
    if includes.tokens > MAX_FULL_HOCON_TOKENS:
        raise ConfigError([_full_hocon_problem(display, scan)])
    depth = includes.depth
    file = ConfigDocument(path, display, {}, locate_keys(text))

    basedir = str(path.parent)
    tree = _with_pyhocon(display, depth, lambda: ConfigFactory.parse_string(text, basedir, resolve=False))
    if not environment:
        references = environment_references(tree)
        if references:
            raise ConfigError(_environment_problems(references, file, includes.files))
    size = expanded_size(tree, MAX_CONFIG_VALUES)
    if size > MAX_CONFIG_VALUES:
        message = f"substitutions would expand this file to more than {MAX_CONFIG_VALUES} values"
        raise ConfigError([Problem(display, None, (), message, "refer to big values once, not over and over")])
    _with_pyhocon(display, depth, lambda: resolve(tree, environment=environment))
    try:
        return _to_plain(tree, 0), file.key_lines
    except _TooDeep:
        message = f"substitutions nest objects and lists more than {MAX_NESTING_DEPTH} levels deep"
        raise ConfigError([Problem(display, None, (), message, "flatten it")]) from None


def _without_includes(path: Path, display: str, text: str, root: Path, environment: bool) -> ConfigDocument | None:
    """The file read with every include blanked out (lines kept), or None when that cannot be read."""
    try:
        data, key_lines = _read_hocon(path, display, without_includes(text), root, environment)
    except ConfigError:
        return None
    return ConfigDocument(path, display, data, key_lines) if isinstance(data, dict) else None


def _full_hocon_problem(display: str, scan: ConfigScan) -> Problem:
    at = f"{scan.full_hocon_text!r}" if scan.full_hocon_text else "the end of the file"
    message = (
        f"{at} needs the full HOCON parser, which reads at most {MAX_FULL_HOCON_TOKENS} tokens, and this file "
        "and its includes hold more (an include, ${...}, +=, a duration or values side by side need it, and so "
        "does a syntax error)"
    )
    hint = "write plain HOCON or JSON, which has no such limit, or move big data to a data file the component reads"
    return Problem(display, scan.full_hocon_line, (), message, hint)


#: pyhocon changes pyparsing's global whitespace settings while it parses, so two threads
#: parsing at once (two submits, or a submit while the scheduler loads a job) can misparse a
#: valid file: every pyhocon step runs under this lock.
_PYHOCON_LOCK = threading.Lock()
#: Python frames pyparsing (and pyhocon's resolution) use per level of nesting; measured 25-35.
_PYHOCON_FRAMES_PER_LEVEL = 40


def _with_pyhocon(display: str, depth: int, step: Callable[[], Any]) -> Any:
    """Run a pyhocon step (one at a time); turn what it raises into a `ConfigError` naming the file and line.

    ``depth``: how deep the file nests; the recursion limit is raised for the step to reach
    `MAX_NESTING_DEPTH` (pyparsing recurses about 30 frames a level, 1000 would stop at 30).
    """
    try:
        with _PYHOCON_LOCK:
            limit = sys.getrecursionlimit()
            sys.setrecursionlimit(limit + _PYHOCON_FRAMES_PER_LEVEL * depth)
            try:
                return step()
            finally:
                sys.setrecursionlimit(limit)
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


class _TooDeep(FlengineError):
    """Substitutions made the resolved tree deeper than `MAX_NESTING_DEPTH` (control flow inside this module)."""


def _to_plain(value: Any, depth: int) -> Any:
    """Turn pyhocon's trees and lists into plain dicts and lists (durations become seconds)."""
    if isinstance(value, (ConfigTree, list)):
        if depth > MAX_NESTING_DEPTH:
            raise _TooDeep
        if isinstance(value, ConfigTree):
            return {_unquote(key): _to_plain(item, depth + 1) for key, item in value.items()}
        return [_to_plain(item, depth + 1) for item in value]
    if isinstance(value, NoneValue):  # pyhocon leaves these in lists nested in lists
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
        return int(seconds) if seconds.is_integer() else seconds
    return value


def _unquote(key: str) -> str:
    # pyhocon keeps the quotes of a quoted key that contains a dot ("a.b" = 1).
    if len(key) >= 2 and key[0] == key[-1] == '"':
        return key[1:-1]
    return key
