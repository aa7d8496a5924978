"""A tiny terminal: what a screen and its scrollback show after some output (for the live console's tests).

It knows what rich's live display writes: text, CR, LF, cursor up (``ESC[nA``), erase line
(``ESC[2K``), colours (``ESC[...m``) and show/hide cursor (``ESC[?25h/l``); any other escape
sequence is kept in `unknown` so that a test can fail on it. Lines are as wide as the text
written; nothing wraps (tests use a console as wide as the lines they print).
"""

from __future__ import annotations

import re

_CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")


class Terminal:
    """Feeds output into rows of text; `lines` is everything still visible, scrollback included."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = [[]]
        self.row = 0
        self.col = 0
        self.unknown: list[str] = []

    def feed(self, text: str) -> Terminal:
        """Apply ``text`` (output of a program) to the screen."""
        index = 0
        while index < len(text):
            match = _CSI.match(text, index)
            if match:
                self._csi(match.group(1), match.group(2), match.group(0))
                index = match.end()
                continue
            char = text[index]
            index += 1
            if char == "\r":
                self.col = 0
            elif char == "\n":
                self.row += 1
                self.col = 0
                while len(self.rows) <= self.row:
                    self.rows.append([])
            elif char == "\x1b":
                self.unknown.append(repr(text[index - 1 : index + 8]))
            else:
                line = self.rows[self.row]
                while len(line) < self.col:
                    line.append(" ")
                if self.col < len(line):
                    line[self.col] = char
                else:
                    line.append(char)
                self.col += 1
        return self

    def _csi(self, params: str, command: str, whole: str) -> None:
        if command == "m" or params in ("?25", "?25l") or (params == "?25" and command in "hl"):
            return
        if command in "hl" and params == "?25":
            return
        if command == "A":
            self.row = max(self.row - int(params or 1), 0)
        elif command == "K" and params == "2":
            self.rows[self.row] = []
        else:
            self.unknown.append(repr(whole))

    @property
    def lines(self) -> list[str]:
        """Each row's text, right-stripped, without the empty rows at the bottom."""
        lines = ["".join(row).rstrip() for row in self.rows]
        while lines and not lines[-1]:
            lines.pop()
        return lines
