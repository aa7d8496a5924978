"""Key material and trust settings of a site: CURVE key files, the allowlist folder, keys folders.

The cells layer applies CURVE (:mod:`engine.cells.security`); this package reads and writes the
files it comes from. Public API::

    from engine.security import load_cell_security, write_key_pair
"""

from __future__ import annotations

from engine.security.keys import (
    ALLOWLIST_FOLDER,
    PUBLIC_SUFFIX,
    SERVER_KEY_FILE,
    load_allowlist,
    load_cell_security,
    load_public_key,
    load_secret_key,
    write_key_pair,
    write_public_key,
    write_site_key_folders,
)

__all__ = [
    "ALLOWLIST_FOLDER",
    "PUBLIC_SUFFIX",
    "SERVER_KEY_FILE",
    "load_allowlist",
    "load_cell_security",
    "load_public_key",
    "load_secret_key",
    "write_key_pair",
    "write_public_key",
    "write_site_key_folders",
]
