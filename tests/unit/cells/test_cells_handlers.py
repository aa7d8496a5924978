"""HandlerRegistry: explicit, refuses duplicates and bad names."""

from __future__ import annotations

import pytest

from engine.cells.handlers import HandlerRegistry


def _handler(message: object) -> None:
    return None


def test_exact_match_beats_wildcard() -> None:
    registry = HandlerRegistry()
    exact, wildcard = (lambda m: None), (lambda m: None)
    registry.register("task", "get", exact)
    registry.register("task", "*", wildcard)

    assert registry.find("task", "get") is exact
    assert registry.find("task", "other") is wildcard
    assert registry.find("other", "get") is None


def test_duplicate_registration_raises() -> None:
    registry = HandlerRegistry()
    registry.register("task", "get", _handler)

    with pytest.raises(ValueError, match="channel='task' topic='get' is already registered"):
        registry.register("task", "get", _handler)


@pytest.mark.parametrize(
    ("channel", "topic", "error"),
    [
        ("", "get", ValueError),
        ("task", "", ValueError),
        (None, "get", ValueError),
        ("task", "get", TypeError),
    ],
    ids=["empty-channel", "empty-topic", "none-channel", "not-callable"],
)
def test_bad_registration_raises(channel: object, topic: object, error: type[Exception]) -> None:
    handler = "not callable" if error is TypeError else _handler
    with pytest.raises(error):
        HandlerRegistry().register(channel, topic, handler)  # type: ignore[arg-type]


def test_unregister() -> None:
    registry = HandlerRegistry()
    registry.register("task", "get", _handler)

    registry.unregister("task", "get")

    assert registry.find("task", "get") is None
    with pytest.raises(KeyError, match="no handler"):
        registry.unregister("task", "get")
