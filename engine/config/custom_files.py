"""Args that name a file in the app's ``custom/`` folder, checked before the job runs.

A component class declares such args in a class attribute::

    class ClientAPIExecutor(Executor):
        CUSTOM_FILE_ARGS = ("task_script_path",)

and `check_custom_files` reports each one whose file is missing, at its file, line and key path
(``executors[0].executor.args.task_script_path: no such file 'trian.py' in the app's custom/
folder (did you mean 'train.py'?)``), instead of a client process dying at start.

Without ``build`` (a server checking a job it received), only flengine's own components are
looked at: importing one runs no code of the job, importing the job's own classes would.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from engine.config.build import ComponentSpec, is_engine_component, resolve_dotted_path
from engine.config.problems import Problem
from engine.config.source import ConfigDocument
from engine.errors import DottedPathError

#: The class attribute a component declares its custom/ file args in.
CUSTOM_FILE_ARGS = "CUSTOM_FILE_ARGS"
#: At most this many files of custom/ are listed to suggest a name (a huge folder is not walked).
_MAX_LISTED_FILES = 2000


def check_custom_files(
    spec: ComponentSpec, document: ConfigDocument, custom_dir: Path | None, *, build: bool
) -> list[Problem]:
    """Return a problem for each arg of ``spec`` that its class says names a file in custom/, and that is missing.

    Args:
        spec: The component entry.
        document: The config it is in (for the file and line of a problem).
        custom_dir: The app's ``custom/`` folder; None when the app has none.
        build: Whether the job's own code may be imported; False checks flengine's
            components only.

    Returns:
        The problems, empty when every named file exists or the class declares no such arg.
        A path that names nothing importable is not reported here: the dry build reports it.
    """
    names = _declared_file_args(spec.path, build=build)
    problems = []
    for name in names:
        value = spec.args.get(name)
        if not isinstance(value, str) or not value:
            continue  # missing or of the wrong type: the signature check reports it
        if Path(value).is_absolute() or ".." in Path(value).parts:
            continue  # leaving custom/ is refused at job start, by the component itself
        if custom_dir is not None and (custom_dir / value).is_file():
            continue
        problems.append(
            document.problem(
                spec.key_path + ("args", name),
                f"no such file {value!r} in the app's custom/ folder",
                _hint(value, custom_dir),
            )
        )
    return problems


def _declared_file_args(path: str, *, build: bool) -> tuple[str, ...]:
    if not build and not is_engine_component(path):
        return ()
    try:
        target = resolve_dotted_path(path)
    except DottedPathError:
        return ()
    declared: Any = getattr(target, CUSTOM_FILE_ARGS, ())
    if isinstance(declared, str) or not isinstance(declared, (tuple, list)):
        return ()
    return tuple(name for name in declared if isinstance(name, str))


def _hint(value: str, custom_dir: Path | None) -> str:
    if custom_dir is None or not custom_dir.is_dir():
        return "the app has no custom/ folder: create app/custom/ and put the file there"
    present = _files_in(custom_dir)
    close = difflib.get_close_matches(value, present, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return "put the file in the app's custom/ folder; the path is relative to it"


def _files_in(folder: Path) -> list[str]:
    found: list[str] = []
    for parent, _, files in os.walk(folder):
        for file in files:
            found.append(os.path.relpath(os.path.join(parent, file), folder))
            if len(found) >= _MAX_LISTED_FILES:
                return found
    return found
