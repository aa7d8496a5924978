"""CellSettings: defaults, config mapping, bounds."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from engine.cells.settings import CellSettings


def test_defaults() -> None:
    settings = CellSettings()

    assert (settings.host, settings.port) == ("127.0.0.1", 0)
    assert (settings.heartbeat_interval_s, settings.heartbeat_timeout_s) == (2.0, 10.0)
    assert settings.max_message_size_bytes == 4 << 30
    assert settings.handler_pool_size == 8
    assert settings.request_timeout_s == 60.0


def test_from_config_reads_every_key_and_leaves_input_alone() -> None:
    config = {
        "host": "0.0.0.0",
        "port": 8002,
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 3,
        "max_message_size_bytes": 1 << 20,
        "handler_pool_size": 2,
        "request_timeout_s": 5,
    }
    before = copy.deepcopy(config)

    settings = CellSettings.from_config(config)

    assert config == before
    assert settings == CellSettings(**config)


def test_from_config_empty_gives_defaults() -> None:
    assert CellSettings.from_config({}) == CellSettings()


def test_from_config_unknown_key_is_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"cell\.heartbeat_ivl: unknown setting; known settings "
        r"are .*heartbeat_interval_s",
    ):
        CellSettings.from_config({"heartbeat_ivl": 1})


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"host": ""}, "host"),
        ({"port": -1}, "port"),
        ({"port": 65536}, "port"),
        ({"port": "8002"}, "port"),
        ({"port": True}, "port"),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": float("nan")}, "heartbeat_interval_s"),
        ({"heartbeat_timeout_s": 3.0}, "heartbeat_timeout_s"),
        ({"max_message_size_bytes": 1023}, "max_message_size_bytes"),
        ({"max_message_size_bytes": 1.5e9}, "max_message_size_bytes"),
        ({"handler_pool_size": 0}, "handler_pool_size"),
        ({"handler_pool_size": 1025}, "handler_pool_size"),
        ({"request_timeout_s": -1}, "request_timeout_s"),
    ],
    ids=[
        "host-empty",
        "port-negative",
        "port-high",
        "port-str",
        "port-bool",
        "interval-zero",
        "interval-nan",
        "timeout-below-2x-interval",
        "size-small",
        "size-float",
        "pool-zero",
        "pool-high",
        "request-timeout-negative",
    ],
)
def test_out_of_bounds_value_names_key_and_value(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=rf"cell\.{key}: expected .*, got"):
        CellSettings.from_config(overrides)
