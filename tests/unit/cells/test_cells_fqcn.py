"""FQCN grammar and helpers."""

from __future__ import annotations

import pytest

from engine.cells.fqcn import check_fqcn, is_valid_fqcn, parent_of, root_of


@pytest.mark.parametrize("name", ["server", "site-1", "site_2", "site-1.job1", "a.b.c", "9lives", "x" * 255], ids=str)
def test_valid_names(name: str) -> None:
    assert is_valid_fqcn(name)
    assert check_fqcn(name) == name


@pytest.mark.parametrize(
    "name",
    ["", ".", "site-1.", ".site", "a..b", "-site", "site 1", "site/1", "x" * 256, None, 7, b"server"],
    ids=[
        "empty",
        "dot",
        "trailing-dot",
        "leading-dot",
        "double-dot",
        "leading-dash",
        "space",
        "slash",
        "too-long",
        "none",
        "int",
        "bytes",
    ],
)
def test_invalid_names(name: object) -> None:
    assert not is_valid_fqcn(name)
    with pytest.raises(ValueError, match=r"target: .* is not a valid cell name"):
        check_fqcn(name, "target")


@pytest.mark.parametrize(
    ("name", "root", "parent"),
    [
        ("server", "server", None),
        ("site-1.job1", "site-1", "site-1"),
        ("a.b.c", "a", "a.b"),
    ],
    ids=["root", "child", "grandchild"],
)
def test_root_and_parent(name: str, root: str, parent: str | None) -> None:
    assert root_of(name) == root
    assert parent_of(name) == parent
