"""One command line: every command has a description, a short flag means the same in every command,
tables have headers and the same column order, and what the commands write into a checkout is
ignored by git."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cli import _parser, main
from engine.deploy.poc.prepare import free_port_block

REPO = Path(__file__).resolve().parents[2]
#: Short flags whose long forms differ by command but mean one thing: how many sites to run.
SYNONYMS = {"-n": {"--clients", "--sites"}}


def commands(parser: argparse.ArgumentParser, path: str = "flengine") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command and subcommand of ``parser``: ``("flengine poc start", its parser)``, the root too."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


def subcommand_helps(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str | None]]:
    for path, command in commands(parser):
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    yield f"{path} {choice.dest}", choice.help


ALL = list(commands(_parser()))


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[path for path, _ in ALL])
def test_every_command_has_a_description(path: str, parser: argparse.ArgumentParser) -> None:
    assert (parser.description or "").strip(), f"`{path} --help` says nothing about what it does"


def test_every_subcommand_has_a_help_line() -> None:
    missing = [path for path, text in subcommand_helps(_parser()) if not (text or "").strip()]

    assert missing == []


def test_a_short_flag_means_the_same_in_every_command() -> None:
    meanings: dict[str, set[str]] = {}
    for _, parser in ALL:
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:  # a moved flag, kept to say where it went
                continue
            shorts = [o for o in action.option_strings if not o.startswith("--")]
            longs = {o for o in action.option_strings if o.startswith("--")}
            for short in shorts:
                meanings.setdefault(short, set()).update(longs)

    mixed = {short: longs for short, longs in meanings.items() if len(longs) > 1 and longs != SYNONYMS.get(short)}
    assert mixed == {}
    assert meanings["-o"] == {"--output"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["poc", "status", "-o", "x"], "-o is --output in every flengine command; the POC folder is -d DIR"),
        (["new", "x", "-t", "swarm"], "-t is --workers of `flengine run`; the template is --template NAME"),
    ],
    ids=["poc-o", "new-t"],
)
def test_a_moved_short_flag_is_a_usage_error_that_names_its_new_form(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)

    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_the_long_form_of_the_poc_folder_still_works(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["poc", "status", "--folder", str(tmp_path / "nowhere")])

    assert code == 1
    assert "not a prepared POC" in capsys.readouterr().err


def test_provision_and_poc_prepare_print_the_same_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["poc", "prepare", "-n", "1", "--port", str(free_port_block(11))]) == 0
    prepared = capsys.readouterr().out.splitlines()

    assert main(["provision", "poc/project.conf", "-o", "kits"]) == 0
    provisioned = capsys.readouterr().out.splitlines()

    header = "status   name    kind    folder"
    assert prepared[:4] == [header, *(f"created  {n:<6}  {k:<6}  poc/kits/{n}" for n, k in SERVER_SITE_ADMIN)]
    assert provisioned[:4] == [header, *(f"created  {n:<6}  {k:<6}  kits/{n}" for n, k in SERVER_SITE_ADMIN)]


SERVER_SITE_ADMIN = [("server", "server"), ("site-1", "site"), ("admin", "admin")]


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a checkout")
def test_what_the_commands_write_into_a_checkout_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # `poc prepare` writes ./poc, its secret keys included
    assert main(["poc", "prepare", "--port", str(free_port_block(11))]) == 0
    written = [str(path.relative_to(tmp_path)) for path in (tmp_path / "poc").rglob("*") if path.is_file()]
    others = [
        "workspace/fedavg-20260101-120000/server/log.txt",  # flengine run's default workspace
        "kits/site-1/keys/site-1.key_secret",  # flengine provision -o kits, as the docs write it
        "kits/server-workspace/jobs/x/meta.json",  # server start's default workspace, beside its kit
        "3f9c0a1b2c4d/server/log.txt",  # admin download JOB: into ./JOB by default
    ]

    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *written, *others],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert any(name.endswith("_secret") for name in written)
    not_ignored = [line.split("\t", 1)[1] for line in checked.stdout.splitlines() if line.startswith("::")]
    assert not_ignored == []
    assert (
        subprocess.run(["git", "check-ignore", "-q", "--no-index", "engine/deploy/poc/x.py"], cwd=REPO).returncode == 1
    )
