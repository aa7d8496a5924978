"""The files of a recipe's ``app/custom/`` folder: the training script and the files and folders it needs."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from engine.recipes.hocon import check_config_value

#: What is never copied from a folder: compiled Python and version-control folders.
_SKIPPED = frozenset({"__pycache__", ".git", ".hg", ".svn"})


def custom_entries(train_script: Path, custom_files: Sequence[str | os.PathLike[str]]) -> dict[str, Path]:
    """Map each top-level name of ``app/custom/`` to the file or folder it is copied from.

    The script and every entry of ``custom_files`` keep their names at the top of ``custom/``.

    Raises:
        TypeError: ``custom_files`` is not a list of paths.
        ValueError: An entry does not exist, or two entries have the same name.
    """
    if isinstance(custom_files, (str, os.PathLike)) or not isinstance(custom_files, Sequence):
        raise TypeError(f"custom_files: expected a list of files and folders, got {custom_files!r}")
    entries = {train_script.name: train_script}
    owners = {train_script.name: "train_script"}
    for index, entry in enumerate(custom_files):
        where = f"custom_files[{index}]"
        if not isinstance(entry, (str, os.PathLike)):
            raise TypeError(f"{where}: expected a file or folder path, got {entry!r}")
        source = Path(entry)
        if not source.exists():
            raise ValueError(f"{where}: no such file or folder {str(source)!r}")
        name = source.resolve().name
        check_config_value(name, where)
        if name in owners:
            raise ValueError(f"{where}: {str(source)!r} has the name {name!r} of {owners[name]} in custom/; rename one")
        owners[name] = where
        entries[name] = source
    return entries


def custom_contents(entries: Mapping[str, Path]) -> dict[str, Path]:
    """Map each file of ``app/custom/`` (relative POSIX path) to the file it is copied from, as they are now.

    A folder brings every file under it (``__pycache__``, ``.pyc`` and version-control folders
    left out; symbolic links to folders are not followed).
    """
    contents: dict[str, Path] = {}
    for name, source in entries.items():
        if source.is_dir():
            contents.update({f"{name}/{relative}": file for relative, file in _files_under(source)})
        else:
            contents[name] = source
    return contents


def custom_module_names(entries: Mapping[str, Path]) -> set[str]:
    """The top-level modules ``custom/`` provides: ``net`` for ``net.py``, ``pkg`` for a folder ``pkg``."""
    return {
        name[: -len(".py")] if name.endswith(".py") else name
        for name, source in entries.items()
        if source.is_dir() or name.endswith(".py")
    }


def _files_under(folder: Path) -> Iterable[tuple[str, Path]]:
    for parent, folders, files in os.walk(folder):
        folders[:] = sorted(name for name in folders if name not in _SKIPPED)
        for file in sorted(files):
            if file.endswith(".pyc"):
                continue
            path = Path(parent) / file
            yield path.relative_to(folder).as_posix(), path
