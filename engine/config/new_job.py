"""`new_job`: write a job folder from one of the templates of `engine.templates` (``flengine new``).

A template is ``engine/templates/<template>/`` (``meta.conf`` and ``app/config/``) plus the
training script every template shares, the digits example's ``engine/examples/train.py``, which
becomes the job's ``app/custom/train.py``: a copy of the engine's own, to edit. The job's name and
its number of rounds are the two lines written differently from the template.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import UsageError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

#: The templates ``flengine new --template`` offers, each with what it makes.
TEMPLATES = {
    "fedavg": "FedAvg over the digits MLP (the server averages the clients' models)",
    "swarm": "Swarm learning over the digits MLP (the clients aggregate among themselves)",
    "cse": "Swarm learning, then cross-site evaluation (every site validates every model)",
}
DEFAULT_TEMPLATE = "fedavg"
#: The training script of every template (a file of this package), and where a new job gets it.
TRAINING_SCRIPT = ("engine.examples", "train.py")
TRAINING_SCRIPT_IN_JOB = "app/custom/train.py"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_NAME_LINE = re.compile(r"^name = .*$", re.MULTILINE)
_ROUNDS_LINE = re.compile(r"^(\s*num_rounds = )\d+$", re.MULTILINE)


@dataclass(frozen=True)
class NewJob:
    """What `new_job` wrote.

    Attributes:
        folder: The job folder.
        template: The template it came from.
        files: The files written, relative to ``folder``, in POSIX form, sorted.
    """

    folder: Path
    template: str
    files: list[str]


def new_job(
    name: str,
    template: str = DEFAULT_TEMPLATE,
    parent: str | os.PathLike[str] = ".",
    num_rounds: int | None = None,
) -> NewJob:
    """Write the job folder ``parent/name`` from ``template``; its ``meta.conf`` names it ``name``.

    Args:
        name: The job's folder and name: letters, digits, ``.``, ``_``, ``-``, not starting with
            ``.`` or ``-`` (no slashes, no ``..``).
        template: One of `TEMPLATES`. Default ``fedavg``.
        parent: The folder the job folder goes in. Default: the current folder.
        num_rounds: Rounds of training (``num_rounds`` of the template's workflow); None keeps
            the template's (3).

    Returns:
        The folder and the files written.

    Raises:
        UsageError: A bad name, template or number of rounds, or ``parent/name`` exists and is
            not an empty folder. Nothing is written then.

    Example:
        >>> new_job("digits", "swarm", parent=tmp_path, num_rounds=1).files[0]
        'app/config/config_fed_client.conf'
    """
    _check_arguments(name, template, num_rounds)
    folder = Path(parent) / name
    refuse_used_folder(folder, "pick another NAME or --dir, or remove it")
    root = resources.files("engine.templates")
    contents = dict(_files_of(root / template))
    package, script = TRAINING_SCRIPT
    contents[TRAINING_SCRIPT_IN_JOB] = resources.files(package).joinpath(script).read_bytes()
    contents["meta.conf"] = _renamed(contents["meta.conf"], name, template)
    if num_rounds is not None:
        contents = {path: _with_rounds(path, data, num_rounds, template) for path, data in contents.items()}
    write_files(folder, contents)
    return NewJob(folder, template, sorted(contents))


def is_plain_name(name: str) -> bool:
    """Whether ``name`` is a plain job name: letters, digits, ``.``, ``_``, ``-``, not starting with ``.`` or ``-``."""
    return _PLAIN_NAME.fullmatch(name) is not None


def refuse_used_folder(folder: Path, fix: str) -> None:
    """Raise `UsageError` unless ``folder`` is missing or an empty folder; ``fix`` ends the message.

    The one check of every writer of job folders (``flengine new``, `engine.recipes`' ``export``).
    """
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        what = "a folder that is not empty" if folder.is_dir() else "not a folder"
        raise UsageError(f"{folder}: already exists and is {what}; {fix}")


def write_files(folder: Path, contents: Mapping[str, bytes | Path]) -> None:
    """Write ``contents`` under ``folder``, making folders as needed.

    Args:
        folder: Where the files go.
        contents: Relative POSIX path -> the file's bytes, or a file to copy (read a block at a
            time, so a large data file is never held in memory).
    """
    for path, data in contents.items():
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, Path):
            shutil.copyfile(data, target)
        else:
            target.write_bytes(data)


def _check_arguments(name: str, template: str, num_rounds: int | None) -> None:
    if not is_plain_name(name):
        raise UsageError(
            f"job name {name!r}: expected a plain folder name (letters, digits, '.', '_', '-', not starting "
            "with '.' or '-'); put the folder it goes in with --dir"
        )
    if template not in TEMPLATES:
        raise UsageError(f"template {template!r}: expected one of {', '.join(TEMPLATES)}")
    if num_rounds is not None and num_rounds < 1:
        raise UsageError(f"rounds: expected a positive integer, got {num_rounds}")


def _files_of(folder: Traversable, prefix: str = "") -> list[tuple[str, bytes]]:
    """Every file under ``folder`` as ``(relative POSIX path, bytes)``; compiled Python is skipped."""
    found = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name == "__pycache__" or entry.name.endswith(".pyc"):
            continue
        if entry.is_dir():
            found.extend(_files_of(entry, f"{prefix}{entry.name}/"))
        else:
            found.append((f"{prefix}{entry.name}", entry.read_bytes()))
    return found


def _renamed(meta: bytes, name: str, template: str) -> bytes:
    text, count = _NAME_LINE.subn(f"name = {json.dumps(name)}", meta.decode("utf-8"), count=1)
    if count != 1:
        raise RuntimeError(f"engine/templates/{template}/meta.conf has no 'name = ...' line")
    return text.encode("utf-8")


def _with_rounds(path: str, data: bytes, num_rounds: int, template: str) -> bytes:
    if not path.startswith("app/config/"):
        return data
    text, count = _ROUNDS_LINE.subn(rf"\g<1>{num_rounds}", data.decode("utf-8"))
    if path.endswith("config_fed_server.conf") and count != 1:
        raise RuntimeError(f"engine/templates/{template}/{path}: expected one 'num_rounds = N' line, found {count}")
    return text.encode("utf-8")
