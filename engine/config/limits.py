"""The limits on a config file, in one place.

Job configs arrive from other organisations, so every file (the main one, each file it includes,
``meta.conf``/``meta.json``) is measured against these limits before a parser sees it: a file
over one is refused with a problem that names the file, the line and the limit, never a hang, a
`RecursionError` or a traceback. Real configs stay far below each of them.

`read_config_text` enforces the limits on the file itself (a regular file, its size, UTF-8);
`engine.config.scan` those on its content.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.config.problems import Problem
from engine.errors import ConfigError

#: Largest config file, in bytes; each included file is measured on its own.
MAX_CONFIG_FILE_BYTES = 16 * 1024 * 1024

#: Deepest nesting of objects and lists (``a { b { c = [ [ 1 ] ] } }`` is 4 deep). pyparsing,
#: under pyhocon, recurses about 30 frames per level, and the JSON decoder one per level.
MAX_NESTING_DEPTH = 64

#: Most values in one file: every number, string, boolean, null, list and object counts as one,
#: so a list of 150,000 numbers (about 1 MB) is 150,001 values. Bounds the memory a file can
#: make us hold (16 MiB of ``{},`` would be 5 million objects) and the time to refuse it (about
#: 1 s for 200,000 ``{}`` or ``key = value`` lines on this project's VM, 2 vCPU), and also what
#: substitutions may expand to.
MAX_CONFIG_VALUES = 200_000

#: Most tokens (values, keys, brackets, commas, ``=``, line ends) a file and what it includes may
#: hold when it needs the full HOCON parser, pyhocon: for an include, a ``${...}`` substitution,
#: ``+=``, a duration, concatenated values, or a syntax error. pyhocon takes 35-120 µs a token
#: on this project's VM, holding a process-wide lock meanwhile, so this bounds it to about 2 s;
#: plain files (none of those) are read by `engine.config.scan`, about a million values a
#: second, where only `MAX_CONFIG_VALUES` applies.
MAX_FULL_HOCON_TOKENS = 16_000

#: Most includes followed for one config, counting a file included twice twice (a file that
#: includes ``b.conf`` twice, each of which includes ``c.conf`` twice, ... grows exponentially).
MAX_INCLUDES = 64

_BIG_DATA_HINT = "keep big data (weights, sample lists) in a data file that the component reads, not in its config"


def read_config_text(path: Path, display: str) -> str:
    """Read a config file as UTF-8 text, refusing what is not a regular file or is over the size limit.

    Args:
        path: The file.
        display: How to name it in messages.

    Raises:
        ConfigError: One problem: the file cannot be read, is not a regular file (a folder, a
            pipe), is larger than `MAX_CONFIG_FILE_BYTES`, or is not UTF-8.
    """

    def refuse(message: str, hint: str | None = None) -> ConfigError:
        return ConfigError([Problem(display, None, (), message, hint)])

    try:
        # O_NONBLOCK: opening a named pipe must not wait for a writer; fstat then tells what it is
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a pipe, a device (/dev/zero never ends)
                raise refuse("not a regular file", "name a .conf or .json file")
            raw = file.read(MAX_CONFIG_FILE_BYTES + 1)
    except IsADirectoryError as e:
        raise refuse("not a regular file", "name a .conf or .json file") from e
    except OSError as e:
        raise refuse(f"cannot read the file: {e}") from e
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        size = f"{MAX_CONFIG_FILE_BYTES} bytes ({MAX_CONFIG_FILE_BYTES / 2**20:g} MiB)"
        raise refuse(f"the file is larger than {size}", _BIG_DATA_HINT)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        message = (
            f"cannot read the file: 'utf-8' codec can't decode byte 0x{raw[e.start]:02x} "
            f"at line {line}, column {column}: {e.reason}"
        )
        raise refuse(message, "save the file as UTF-8") from e
