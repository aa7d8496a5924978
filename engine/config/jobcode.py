"""Making a job's own code (its app's ``custom/`` folder) importable while the job is handled."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def job_code_on_path(custom_dir: Path | None) -> Iterator[None]:
    """Put ``custom_dir`` first on ``sys.path`` for the duration of the block.

    On exit the folder leaves ``sys.path`` again and every module imported from it is forgotten,
    so checking two jobs that both have a ``model.py`` in one process never mixes them up.

    Args:
        custom_dir: The app's ``custom/`` folder; None or a missing folder changes nothing.
    """
    if custom_dir is None or not custom_dir.is_dir():
        yield
        return
    entry = str(custom_dir.resolve())
    sys.path.insert(0, entry)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        if entry in sys.path:
            sys.path.remove(entry)
        for name, module in list(sys.modules.items()):
            if _loaded_from(module, entry):
                del sys.modules[name]


def _loaded_from(module: object, folder: str) -> bool:
    # Modules found through the entry we inserted carry it verbatim as the start of __file__.
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and file.startswith(folder + os.sep)
