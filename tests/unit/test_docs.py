"""The docs show only what exists: commands the real parser takes, links, paths and names that resolve.

README.md and every docs/*.md are read as a user reads them. Every ``flengine ...`` command in a
code block or an inline code span must parse with the ``flengine`` argument parser; every
relative link (and its ``#anchor``) must lead somewhere; every repository path (``engine/...``,
``tools/...``, ``jobs/...``) and every ``engine.`` dotted name must exist; docs/cli.md has a
section for every command. Commands that run jobs are run by the integration tests (the README's
tutorial by tests/integration/test_readme_tutorial.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cli import _parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: Paths a doc names before they exist (none now).
NOT_YET_WRITTEN: set[str] = set()

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_REPO_PATH = re.compile(r"(?<![\w./<>~-])((?:engine|jobs|schemas|tests|tools|docs|\.ci)/[\w.*/-]*)")
_DOTTED = re.compile(r"(?<![\w./-])engine(?:\.[A-Za-z_]\w*)+")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _doc_id(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _without_fences(text: str) -> str:
    return _FENCE.sub("", text)


def flengine_commands(text: str) -> Iterator[str]:
    """Every ``flengine ...`` command of a doc: in code blocks (``$ `` prompts dropped) and in inline code."""
    pieces = []
    for block in _FENCE.findall(text):
        pieces.extend(line.removeprefix("$ ") for line in block.splitlines())
    pieces.extend(" ".join(span.split()) for span in _INLINE.findall(_without_fences(text)))
    for piece in pieces:
        for part in re.split(r"&&|\|\||;|\s\|\s", piece):
            command = re.split(r"\s#", part, maxsplit=1)[0].strip()
            if command.startswith("flengine "):
                yield command


def _parse(command: str) -> argparse.Namespace:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return _parser().parse_args(shlex.split(command)[1:])


def _names_a_command(command: str) -> bool:
    """Whether ``command`` names a command or its options in prose, with no values.

    `flengine new`, `flengine server start`, `flengine run --help`, `flengine run --resume` (the
    option, named) are names; `flengine run JOB` is a command line, which must parse.
    """
    parser = _parser()
    words = shlex.split(command)[1:]
    while words and words[0] in _subcommands(parser):
        parser = _subcommands(parser)[words.pop(0)]
    return all(word in parser._option_string_actions for word in words)


def _not_merged_yet(command: str) -> bool:
    """`flengine admin KIT watch JOB` and `flengine admin KIT logs JOB --follow`, documented as they
    will be once their change lands: while the parser does not know them yet, they are left out."""
    words = shlex.split(command)
    return words[1:2] == ["admin"] and ("watch" in words[3:4] or "--follow" in words)


COMMANDS = sorted({(_doc_id(doc), command) for doc in DOCS for command in flengine_commands(doc.read_text("utf-8"))})


def test_the_docs_show_commands() -> None:
    assert len(COMMANDS) > 40
    assert ("README.md", "flengine run jobs/fedavg --workspace runs/first") in COMMANDS


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{doc}: {command}" for doc, command in COMMANDS])
def test_every_command_a_doc_shows_parses(doc: str, command: str) -> None:
    if _names_a_command(command):
        return
    try:
        args = _parse(command)
    except (Exception, SystemExit) as e:
        if _not_merged_yet(command):
            pytest.skip(f"not in the parser yet: {command}")
        pytest.fail(f"{doc}: `{command}` does not parse: {e!r}")

    assert callable(args.handler), f"{doc}: `{command}` names no command"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def test_cli_md_has_a_section_for_every_command() -> None:
    cli = (REPO / "docs" / "cli.md").read_text("utf-8")
    headings = [title for _, title in _HEADING.findall(cli)]
    commands = _subcommands(_parser())

    missing = [name for name in commands if not any(f"`flengine {name}" in title for title in headings)]
    admin_commands = next(a for a in commands["admin"]._actions if a.dest == "command").choices
    missing += [f"admin {name}" for name in admin_commands if f"| `{name}" not in cli]
    missing += [f"poc {name}" for name in _subcommands(commands["poc"]) if f"flengine poc {name}" not in cli]

    assert missing == [], f"docs/cli.md does not describe: {missing}"


def github_slugs(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown text (``#some-heading``, ``-1`` for repeats)."""
    slugs: set[str] = set()
    for _, title in _HEADING.findall(_without_fences(text)):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in slugs:
            n += 1
            candidate = f"{slug}-{n}"
        slugs.add(candidate)
    return slugs


def _links() -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        for target in _LINK.findall(_without_fences(doc.read_text("utf-8"))):
            if not re.match(r"[a-z]+:", target):
                found.add((_doc_id(doc), target))
    return sorted(found)


@pytest.mark.parametrize(("doc", "target"), _links(), ids=[f"{doc} -> {target}" for doc, target in _links()])
def test_every_relative_link_and_anchor_exists(doc: str, target: str) -> None:
    source = REPO / doc
    path_part, _, anchor = target.partition("#")
    linked = (source.parent / path_part).resolve() if path_part else source
    if linked.relative_to(REPO).as_posix() in NOT_YET_WRITTEN and not linked.exists():
        pytest.skip(f"{target}: not written yet")

    assert linked.exists(), f"{doc}: link to {target}: no such file"
    if anchor:
        assert linked.suffix == ".md", f"{doc}: link to {target}: an anchor into a file that is not markdown"
        assert anchor in github_slugs(linked.read_text("utf-8")), f"{doc}: link to {target}: no such heading"


def repository_paths(text: str) -> set[str]:
    return {match.rstrip(".,:;") for match in _REPO_PATH.findall(text)}


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_repository_path_a_doc_names_exists(doc: Path) -> None:
    missing = []
    for path in sorted(repository_paths(doc.read_text("utf-8"))):
        exists = any(REPO.glob(path)) if "*" in path else (REPO / path).exists()
        if not exists and path not in NOT_YET_WRITTEN:
            missing.append(path)

    assert missing == [], f"{_doc_id(doc)} names paths that are not in the repository: {missing}"


def resolves(dotted: str) -> bool:
    """Whether ``engine.a.b.C`` is an importable module, or an attribute chain on one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_engine_name_a_doc_names_resolves(doc: Path) -> None:
    names = {name for name in _DOTTED.findall(doc.read_text("utf-8"))}

    unresolved = sorted(name for name in names if not resolves(name))

    assert unresolved == [], f"{_doc_id(doc)} names what engine does not have: {unresolved}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```bash\n$ flengine run jobs/fedavg   # 2 clients\n```", ["flengine run jobs/fedavg"]),
        ("```bash\npip install . && flengine run jobs/fedavg\n```", ["flengine run jobs/fedavg"]),
        (
            "run `flengine new my-job`, then `flengine\nvalidate my-job`",
            ["flengine new my-job", "flengine validate my-job"],
        ),
        ("```\n$ flengine run x | cat\nreport: flengine report x\n```", ["flengine run x"]),
        ("`--quiet` and `python -m engine`", []),
    ],
    ids=["prompt-and-comment", "after-and", "inline-over-a-line-break", "pipe-and-output", "not-commands"],
)
def test_commands_are_found_where_a_reader_sees_them(text: str, expected: list[str]) -> None:
    assert list(flengine_commands(text)) == expected


def test_github_slugs_drop_punctuation_and_number_repeats() -> None:
    text = "# A: `b` (c.py)\n## Same\n## Same\n```\n# not a heading\n```\n"

    assert github_slugs(text) == {"a-b-cpy", "same", "same-1"}
