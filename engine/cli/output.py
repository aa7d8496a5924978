"""What the ``flengine`` commands share: ``-v`` and ``--format`` options, JSON documents, counts."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from engine.config import Problem
from engine.config.problems import format_key_path


def print_json(document: Any) -> None:
    """Print ``document`` as indented JSON on stdout."""
    print(json.dumps(document, indent=2, default=str))


def error_document(message: str, exit_code: int, problems: Sequence[Problem] | None = None) -> dict[str, Any]:
    """The JSON document of a failed command: ``{"error", "exit_code"}`` and its problems, if any."""
    document: dict[str, Any] = {"error": message, "exit_code": exit_code}
    if problems is not None:
        document["problems"] = [problem_json(problem) for problem in problems]
    return document


def problem_json(problem: Problem) -> dict[str, Any]:
    """One problem as JSON: file, line, key path, message, hint."""
    return {
        "file": problem.file,
        "line": problem.line,
        "key_path": format_key_path(problem.key_path),
        "message": problem.message,
        "hint": problem.hint,
    }


def add_verbose(parser: argparse.ArgumentParser, text: str = "log debug messages to stderr") -> None:
    """``-v`` after the command too; SUPPRESS keeps the subcommand from resetting a ``-v`` given before it."""
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=text)


def add_format(parser: argparse.ArgumentParser, text: str = "text (default) or json") -> None:
    """``--format text|json``."""
    parser.add_argument("--format", choices=("text", "json"), default="text", help=text)


def add_moved_flag(parser: argparse.ArgumentParser, flag: str, message: str) -> None:
    """A hidden ``flag`` (one value) that is a usage error saying ``message``: a flag that means another thing now.

    A short flag means one thing in every command (``-o`` is ``--output``); a command that used
    it otherwise answers with where its option went instead of a bare "unrecognized arguments".
    """
    parser.add_argument(
        flag, action=_MovedFlag, nargs=1, default=argparse.SUPPRESS, help=argparse.SUPPRESS, moved=message
    )


class _MovedFlag(argparse.Action):
    """The action of `add_moved_flag`: any use is a usage error with its message."""

    def __init__(self, *args: Any, moved: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.moved = moved

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.error(self.moved)


def count(items: Sequence[object], what: str) -> str:
    """``3 problems``, ``1 problem``."""
    return f"{len(items)} {what}{'s' if len(items) != 1 else ''}"
