"""Writing plain data as a HOCON config text that reads back exactly as written.

Every string is written as a JSON string (``json.dumps``), so a quote, ``${``, ``#``, ``//``, a
newline or ``include`` inside a value stays a literal part of the value. A key is written bare only
when it is a plain identifier (``num_rounds``); any other key is quoted, so a key with dots stays
one key (``"a.b" = 1`` is not ``a { b = 1 }``). The few things the HOCON readers cannot carry back
are refused with the key path: control characters other than tab, newline and carriage return
(pyhocon does not read ``\\u`` escapes back), an empty string in a list (pyhocon drops it), a key
that is empty or holds a quote, a backslash or a control character, a float that is not finite, a
nesting deeper than `engine.config.limits.MAX_NESTING_DEPTH`.

Example:
    >>> print(hocon_text({"workflows": [{"id": "fedavg", "args": {"num_rounds": 2}}]}), end="")
    workflows = [
      {
        id = "fedavg"
        args {
          num_rounds = 2
        }
      }
    ]
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from engine.config.limits import MAX_NESTING_DEPTH

_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Words that mean something of their own where a key starts; such keys are quoted.
_RESERVED_WORDS = frozenset({"include", "true", "false", "null", "yes", "no", "on", "off"})
#: Characters a HOCON string carries back through every reader; other control characters do not.
_KEPT_CONTROLS = frozenset("\t\n\r")
_INDENT = "  "


def check_config_value(value: Any, where: str, depth: int = 0) -> None:
    """Raise `ValueError` or `TypeError` naming ``where`` if `hocon_text` cannot write ``value`` faithfully.

    Args:
        value: Plain data: dicts with string keys, lists or tuples, strings, ints, finite
            floats, booleans, None.
        where: The argument or key path named in the error, e.g. ``model_args["hidden"]``.
        depth: The nesting depth of ``value`` (internal).
    """
    if depth > MAX_NESTING_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_NESTING_DEPTH} levels, more than a config may hold")
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} cannot be written in a config; use a finite number")
        return
    if isinstance(value, str):
        _check_text(value, where, "value")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: keys must be strings, got {key!r} ({type(key).__name__})")
            _check_key(key, where)
            check_config_value(item, f"{where}[{key!r}]", depth + 1)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if item == "":
                raise ValueError(
                    f"{where}[{index}]: an empty string in a list is dropped by the HOCON readers (pyhocon's "
                    "behaviour); leave it out or give it a value"
                )
            check_config_value(item, f"{where}[{index}]", depth + 1)
        return
    raise TypeError(
        f"{where}: {type(value).__name__} cannot be written in a config; use dicts, lists, strings, numbers, "
        "booleans or None"
    )


def hocon_text(data: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    """Return ``data`` as a HOCON text: ``key = value`` lines, ``key { ... }`` blocks, ``[...]`` lists.

    Args:
        data: The document (checked with `check_config_value` first).
        header: Comment lines written first, each after ``# ``.

    Raises:
        ValueError, TypeError: A value or key that cannot be written faithfully (see the module).
    """
    check_config_value(data, "config")
    lines = [f"# {line}".rstrip() for text in header for line in text.splitlines() or [""]]
    for key, value in data.items():
        lines.extend(_field(key, value, 0))
    return "\n".join(lines) + "\n"


def hocon_key(key: str) -> str:
    """``key`` bare when it is a plain identifier, else quoted as a JSON string."""
    if _BARE_KEY.fullmatch(key) and key.lower() not in _RESERVED_WORDS:
        return key
    return json.dumps(key, ensure_ascii=False)


def _field(key: str, value: Any, level: int) -> list[str]:
    pad = _INDENT * level
    if isinstance(value, Mapping):
        if not value:
            return [f"{pad}{hocon_key(key)} {{}}"]
        return [f"{pad}{hocon_key(key)} {{", *_members(value, level + 1), f"{pad}}}"]
    first, *rest = _value(value, level)
    return [f"{pad}{hocon_key(key)} = {first}", *rest]


def _members(data: Mapping[str, Any], level: int) -> list[str]:
    lines: list[str] = []
    for key, value in data.items():
        lines.extend(_field(key, value, level))
    return lines


def _value(value: Any, level: int) -> list[str]:
    """``value`` as lines; the first continues the line of its key, the rest are indented for ``level``."""
    pad = _INDENT * level
    if isinstance(value, Mapping):
        if not value:
            return ["{}"]
        return ["{", *_members(value, level + 1), f"{pad}}}"]
    if isinstance(value, (list, tuple)):
        if all(not isinstance(item, (Mapping, list, tuple)) for item in value):
            return ["[" + ", ".join(_scalar(item) for item in value) + "]"]
        lines = ["["]
        for index, item in enumerate(value):
            item_lines = _value(item, level + 1)
            item_lines[0] = f"{pad}{_INDENT}{item_lines[0]}"
            if index < len(value) - 1:  # a comma: without it "" then { reads as one concatenated value
                item_lines[-1] += ","
            lines.extend(item_lines)
        return [*lines, f"{pad}]"]
    return [_scalar(value)]


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(int(value)) if isinstance(value, int) else repr(float(value))
    return json.dumps(value, ensure_ascii=False)


def _check_text(text: str, where: str, what: str) -> None:
    bad = next((c for c in text if (ord(c) < 0x20 and c not in _KEPT_CONTROLS) or 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        raise ValueError(
            f"{where}: the {what} {text[:40]!r} holds the character U+{ord(bad):04X}, which a config file cannot "
            "carry; remove it (tab, newline and carriage return are fine)"
        )


def _check_key(key: str, where: str) -> None:
    if not key:
        raise ValueError(f"{where}: an empty key cannot be written in a config; give it a name")
    _check_text(key, where, "key")
    if any(c in key for c in '"\\\t\n\r'):
        raise ValueError(
            f"{where}: the key {key!r} holds a quote, a backslash or a line break, which a config key cannot "
            "carry; rename it"
        )
