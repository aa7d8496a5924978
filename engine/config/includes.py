"""The includes of a HOCON config, checked before pyhocon follows any of them.

pyhocon follows an include wherever its grammar meets one and reads whatever it names: a URL, a
file anywhere on the machine, every file a glob matches, or, for a plain include of a missing
file, nothing at all without a word. A job's config is hostile input, so `check_includes` walks
every include first (as `find_includes` finds them: in the main file, then depth first in what
it includes) and refuses each that does not name one existing regular file inside the job
folder, literally. Refused: a URL, a classpath or package include, a path that leaves the job
folder (symbolic links followed), a wildcard, a substitution (``include ${HOME}"/x.conf"``), a
missing file (``include "x.conf"`` as much as ``include required("x.conf")``: a job that leans on
a file it does not ship is a mistake to report, not to skip), a folder or a pipe, an include
cycle, and more than `MAX_INCLUDES` includes in all. Each included file is measured against the
limits (`read_config_text`, `scan_config`) like the main one.

Example::

    included = check_includes(path, display, text, scan_config(text, display), job_folder)
    if included.problems:
        raise ConfigError(included.problems)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.config.limits import MAX_INCLUDES, read_config_text
from engine.config.locate import IncludeDirective, find_includes, find_substituted_includes
from engine.config.problems import Problem
from engine.config.scan import ConfigScan, scan_config
from engine.errors import ConfigError

_REMOTE_PREFIXES = ("http://", "https://", "file://")


def check_includes(path: Path, display: str, text: str, scan: ConfigScan, root: Path) -> IncludeCheck:
    """Check every include of a HOCON file and of what it includes, without following one with pyhocon.

    Args:
        path: The file.
        display: How to name it in messages.
        text: Its text.
        scan: Its `scan_config`.
        root: The job folder; nothing outside it may be included.

    Returns:
        What was found; ``problems`` lists every include refused, and one problem when more than
        `MAX_INCLUDES` includes would be followed.
    """
    check = IncludeCheck(root)
    walk = _Walk(check)
    check.files[path.resolve()] = display
    check.count, check.tokens = walk.visit(path, display, text, scan, (path.resolve(),), (display,))
    if not check.problems and check.count > MAX_INCLUDES:
        message = f"follows {check.count} includes (a file included twice counts twice), at most {MAX_INCLUDES}"
        check.problems.append(Problem(display, None, (), message, "include each shared file once, from the main file"))
    return check


@dataclass
class IncludeCheck:
    """What `check_includes` found.

    Attributes:
        root: The job folder; nothing outside it may be included.
        files: Every file read, by real path, with the name messages give it.
        problems: What is refused.
        count: Includes pyhocon would follow, a file included twice counted twice.
        tokens: Tokens pyhocon would read, likewise.
        depth: The files' nesting depths added up: how deep pyhocon may recurse, at most.
    """

    root: Path
    files: dict[Path, str] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    count: int = 0
    tokens: int = 0
    depth: int = 0


@dataclass
class _Walk:
    """The depth-first walk of `check_includes`, filling ``check``."""

    check: IncludeCheck
    totals: dict[Path, tuple[int, int]] = field(default_factory=dict)  # per file: (includes, tokens) under it

    def visit(
        self, path: Path, display: str, text: str, scan: ConfigScan, chain: tuple[Path, ...], names: tuple[str, ...]
    ) -> tuple[int, int]:
        """Return (includes, tokens) of ``path`` and what it includes, with multiplicity."""
        self.check.depth += scan.depth + 2  # an include is a few more levels of pyhocon's own calls
        count, tokens = 0, scan.tokens
        for include in find_substituted_includes(text):
            message = f"include {include.target}: an include names its file literally, never through ${{...}}"
            self.check.problems.append(Problem(display, include.line, (), message, 'write the path: include "x.conf"'))
        for include in find_includes(text):
            target = self._target(path, display, include)
            if target is None:
                continue
            real = target.resolve()
            target_display = os.path.normpath(os.path.join(os.path.dirname(display), include.target))
            if real in chain:
                cycle = " -> ".join((*names[chain.index(real) :], target_display))
                message = f"{_written(include)} makes an include cycle: {cycle}"
                self.check.problems.append(Problem(display, include.line, (), message, "remove one of these includes"))
                continue
            if real not in self.totals:
                try:
                    included = read_config_text(target, target_display)
                    included_scan = scan_config(included, target_display)
                except ConfigError as e:
                    self.check.problems.extend(e.problems)
                    self.totals[real] = (0, 0)
                    continue
                self.check.files.setdefault(real, target_display)
                chain_after, names_after = (*chain, real), (*names, target_display)
                self.totals[real] = self.visit(
                    target, target_display, included, included_scan, chain_after, names_after
                )
            under_count, under_tokens = self.totals[real]
            count += 1 + under_count
            tokens += under_tokens
        return count, tokens

    def _target(self, path: Path, display: str, include: IncludeDirective) -> Path | None:
        """The file an include names, as pyhocon would open it; None (a problem added) if refused."""
        target = path.parent / include.target  # unnormalized: `link/..` means what the OS makes of it
        refusal = _refusal(include, target, self.check.root)
        if refusal is None:
            return target
        message, hint = refusal
        self.check.problems.append(Problem(display, include.line, (), _written(include) + message, hint))
        return None


def _refusal(include: IncludeDirective, target: Path, root: Path) -> tuple[str, str | None] | None:
    """Why an include is refused (what follows ``include 'x.conf'`` in the message, and the fix), or None."""
    if include.kind in ("url", "classpath", "package") or include.target.startswith(_REMOTE_PREFIXES):
        return ": only files inside the job folder may be included", None
    if "*" in include.target or "?" in include.target:
        return (
            ": wildcards are not supported (pyhocon would include every file they match)",
            "name one file per include",
        )
    if "*" in str(target) or "?" in str(target):  # pyhocon globs the whole path
        folder = str(target.parent)
        return f": the path {folder!r} holds * or ?, which pyhocon reads as wildcards", "use a path without them"
    if not _is_within(target, root.resolve()):
        return f" reaches outside the job folder {str(root)!r}", "copy the shared file into the job folder"
    if not target.exists():  # HOCON skips a plain include of a missing file; a job must ship it
        return ": no such file", "fix the name, or ship the file with the job"
    if not target.is_file():  # a pipe would block pyhocon
        return (
            f": {'a folder' if target.is_dir() else 'not a regular file'}, not a config file",
            "name a .conf or .json file",
        )
    return None


def _written(include: IncludeDirective) -> str:
    """An include as messages show it: ``include 'x.conf'`` or ``include file('x.conf')``."""
    if include.kind == "plain":
        return f"include {include.target!r}"
    return f"include {include.kind}({include.target!r})"


def _is_within(path: Path, root_real: Path) -> bool:
    try:
        path.resolve().relative_to(root_real)
    except ValueError:
        return False
    return True
