"""``tensor_pool_idle_release_s``: how long a job's processes keep tensor memory for reuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config.schema import check_document, top_level_defaults
from engine.config.source import ConfigDocument
from engine.fobs.tensor_pool import DEFAULT_IDLE_RELEASE_S, TENSOR_POOL, TensorPool
from engine.runtime.assembly import configure_tensor_pool

SIDES = ["config_fed_server", "config_fed_client"]
HINT = "(seconds, 0 or more, e.g. 10; longer than the pause between a site's rounds to reuse memory every round)"


@pytest.fixture
def restore_pool():
    yield
    TENSOR_POOL.configure(DEFAULT_IDLE_RELEASE_S)


def document(side: str, **keys: Any) -> ConfigDocument:
    data: dict[str, Any] = {"format_version": 2, **keys}
    if side == "config_fed_server":
        data["workflows"] = [{"id": "wf", "path": "a.B"}]
    else:
        data["executors"] = [{"tasks": ["*"], "executor": {"path": "a.B"}}]
    return ConfigDocument(Path("c.conf"), "c.conf", data)


@pytest.mark.parametrize("side", SIDES)
def test_the_code_default_is_the_schema_default(side: str) -> None:
    assert top_level_defaults(side)["tensor_pool_idle_release_s"] == DEFAULT_IDLE_RELEASE_S == 10


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(0, [], id="zero"),
        pytest.param(120.5, [], id="float"),
        pytest.param(-1, [f"c.conf: tensor_pool_idle_release_s: must be >= 0, got -1 {HINT}"], id="negative"),
        pytest.param("ten", [f'c.conf: tensor_pool_idle_release_s: expected a number, got "ten" {HINT}'], id="string"),
    ],
)
def test_schema_of_the_idle_release_time(side: str, value: object, expected: list[str]) -> None:
    problems = [str(p) for p in check_document(document(side, tensor_pool_idle_release_s=value), side)]

    assert problems == expected


@pytest.mark.usefixtures("restore_pool")
def test_a_config_sets_the_process_pool_and_an_absent_key_restores_the_default() -> None:
    configure_tensor_pool({"tensor_pool_idle_release_s": 90})
    assert TENSOR_POOL.idle_release_s == 90

    configure_tensor_pool({})
    assert TENSOR_POOL.idle_release_s == DEFAULT_IDLE_RELEASE_S


@pytest.mark.parametrize("value", [-1, True, "10"], ids=["negative", "bool", "string"])
def test_an_invalid_idle_time_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="idle_release_s must be a number of seconds >= 0"):
        TensorPool(idle_release_s=value)  # type: ignore[arg-type]


def test_a_new_idle_time_applies_to_storages_already_free() -> None:
    pool = TensorPool(min_bytes=1 << 20, idle_release_s=60)
    tensor = pool.empty((1 << 20,), torch.uint8)
    del tensor
    pool.release_idle(now=100.0)
    assert pool.release_idle(now=110.0) == 0

    pool.configure(5)

    assert pool.release_idle(now=110.0) == 1 << 20
