"""The page strategy is chosen from the machine's cores, huge page mode and balloon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.fobs import page_strategy
from engine.fobs.page_strategy import (
    BACKGROUND_THREADS,
    OVERRIDE_ENV,
    MachineFacts,
    PageStrategy,
    choose_page_strategy,
    machine_facts,
    page_strategy_here,
    parse_override,
)


@pytest.mark.parametrize(
    ("cores", "huge_pages", "reporting", "expected"),
    [
        (2, "madvise", True, "small:1"),
        (2, "madvise", False, "huge:1"),
        (2, "always", False, "huge:1"),
        (2, "never", False, "small:1"),
        (1, "none", False, "small:0"),
        (1, "madvise", False, "huge:0"),
        (3, "madvise", False, f"huge:{BACKGROUND_THREADS}"),
        (8, "madvise", True, f"small:{BACKGROUND_THREADS}"),
        (64, "never", True, f"small:{BACKGROUND_THREADS}"),
    ],
    ids=[
        "2-cores-balloon",
        "2-cores-thp",
        "2-cores-thp-always",
        "2-cores-thp-off",
        "1-core-no-thp",
        "1-core-thp",
        "3-cores",
        "8-cores-balloon",
        "many-cores-thp-off",
    ],
)
def test_the_strategy_follows_the_machine(cores: int, huge_pages: str, reporting: bool, expected: str) -> None:
    strategy = choose_page_strategy(MachineFacts(cores, huge_pages, reporting))

    assert strategy.name == expected
    assert str(cores) in strategy.reason


@pytest.mark.parametrize(
    ("text", "huge", "threads"), [("huge:2", True, 2), ("small:0", False, 0), (" small:1 ", False, 1)]
)
def test_an_override_names_the_kind_and_the_threads(text: str, huge: bool, threads: int) -> None:
    strategy = parse_override(text)

    assert (strategy.huge_pages, strategy.populate_threads) == (huge, threads)


@pytest.mark.parametrize("text", ["huge", "tiny:1", "small:-1", "small:x", "huge:99", ":2"])
def test_a_bad_override_is_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match=OVERRIDE_ENV):
        parse_override(text)


def test_a_bad_override_falls_back_to_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OVERRIDE_ENV, "fast")

    assert page_strategy_here() == choose_page_strategy(machine_facts())


def test_a_good_override_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OVERRIDE_ENV, "huge:3")

    assert page_strategy_here() == PageStrategy(True, 3, f"set by {OVERRIDE_ENV}")


def test_the_facts_are_read_from_this_machine() -> None:
    facts = machine_facts()

    assert facts.cores == len(os.sched_getaffinity(0))
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if setting.exists():
        assert f"[{facts.huge_pages}]" in setting.read_text()
    else:
        assert facts.huge_pages == "none"


def test_free_page_reporting_is_read_from_the_balloons_feature_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = tmp_path / "virtio3"
    device.mkdir()
    monkeypatch.setattr(page_strategy, "_BALLOONS", tmp_path)
    (device / "features").write_text("0110010" + "0" * 57 + "\n")  # bit 5: VIRTIO_BALLOON_F_REPORTING
    assert page_strategy._free_page_reporting()

    (device / "features").write_text("0110000" + "0" * 57 + "\n")
    assert not page_strategy._free_page_reporting()
    monkeypatch.setattr(page_strategy, "_BALLOONS", tmp_path / "absent")
    assert not page_strategy._free_page_reporting()


def test_the_huge_page_mode_is_the_bracketed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    monkeypatch.setattr(page_strategy, "_THP_ENABLED", setting)
    assert page_strategy._huge_page_mode() == "none"  # no such file

    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"), ("x", "none")):
        setting.write_text(text)
        assert page_strategy._huge_page_mode() == mode
