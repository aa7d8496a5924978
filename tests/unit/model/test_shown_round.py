"""`shown_round`: the round users read counts from 1; `FLModel.current_round` counts from 0."""

from __future__ import annotations

from typing import Any

import pytest

from engine.model import shown_round


@pytest.mark.parametrize(
    ("current_round", "shown"),
    [(0, 1), (4, 5), (-1, 0), (None, None), ("3", "3"), (True, True), (2.0, 2.0)],
    ids=["first", "fifth", "a-peer-claims-minus-one", "unknown", "text", "bool-is-no-round", "float"],
)
def test_an_int_round_is_shown_from_1_and_anything_else_as_it_is(current_round: Any, shown: Any) -> None:
    assert shown_round(current_round) == shown
    assert type(shown_round(current_round)) is type(shown)
