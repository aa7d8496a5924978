"""Text from peers, made safe to print: `printable` escapes what a terminal would act on."""

from __future__ import annotations


def printable(text: str, limit: int | None = None) -> str:
    """``text`` with every character a terminal would act on written as an escape (``\\x1b``, ``\\u202e``).

    Control characters (ESC, CR, newline...), format characters (bidirectional overrides) and
    other unprintable ones are escaped; tabs and everything printable stay. With ``limit``, text
    longer than that many characters is cut and ends with ``...``.
    """
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() or ch == "\t" else _escape(ch) for ch in text)
    if limit is not None and len(text) > limit:
        text = text[: max(0, limit - 3)] + "..."
    return text


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
