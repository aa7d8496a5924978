"""`Problem`: one thing wrong with a job, located by file, line and key path."""

from __future__ import annotations

from dataclasses import dataclass

KeyPath = tuple[str | int, ...]


def format_key_path(key_path: KeyPath) -> str:
    """Render a key path the way users write it: ``workflows[0].args.num_rounds``."""
    text = ""
    for part in key_path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


@dataclass(frozen=True)
class Problem:
    """One problem found in a job folder, printed as one line.

    Attributes:
        file: The file the problem is in (as the user named it), or the job folder itself.
        line: 1-based line of the offending key, when known.
        key_path: Where in the file, e.g. ``("workflows", 0, "args", "num_rounds")``; empty for
            problems of the file as a whole.
        message: What is wrong, e.g. ``expected an integer, got "five"``.
        hint: How to fix it, printed in parentheses after the message.
    """

    file: str
    line: int | None
    key_path: KeyPath
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        parts = [where]
        if self.key_path:
            parts.append(format_key_path(self.key_path))
        text = ": ".join(parts) + ": " + self.message
        return f"{text} ({self.hint})" if self.hint else text
