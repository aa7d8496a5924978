"""Streaming settings: the job config's keys, their schema, and the `StreamingContext` built from them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from engine.cells.retry import DEFAULT_RETRIES, DEFAULT_RETRY_BACKOFF_S, RetryPolicy
from engine.config.schema import check_document, top_level_defaults, with_defaults
from engine.config.source import ConfigDocument
from engine.errors import StreamingError
from engine.streaming.consumers import DiskConsumer, MemoryConsumer
from engine.streaming.pull import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MIN_THROUGHPUT
from engine.streaming.via_downloader import DEFAULT_CHUNK_BYTES, DEFAULT_PER_REQUEST_TIMEOUT_S, StreamingContext

CELL = object()  # from_config only stores the cell and the service
SERVICE = object()
MiB = 1024 * 1024
SIDES = ["config_fed_server", "config_fed_client"]

DEFAULTS = {
    "tensor_chunk_bytes": 2 * MiB,
    "array_chunk_bytes": 2 * MiB,
    "per_request_timeout_s": 600.0,
    "transaction_timeout_s": 600.0 + 31.0,  # the retries' waits: 1 + 2 + 4 + 8 + 16 s
    "max_in_flight": 4,
    "min_throughput": 256 * 1024,
    "retry": RetryPolicy(retries=5, backoff_s=1.0),
}


def settings_of(context: StreamingContext) -> dict[str, Any]:
    return {key: getattr(context, key) for key in DEFAULTS}


@pytest.mark.parametrize(
    ("config", "changed"),
    [
        pytest.param({}, {}, id="defaults"),
        pytest.param({"tensor_download_chunk_size": 8 * MiB}, {"tensor_chunk_bytes": 8 * MiB}, id="tensor-chunk"),
        pytest.param({"np_download_chunk_size": 65536}, {"array_chunk_bytes": 65536}, id="array-chunk"),
        pytest.param(
            {"streaming_per_request_timeout": 30},
            {"per_request_timeout_s": 30.0, "transaction_timeout_s": 61.0},
            id="timeout",
        ),
        pytest.param(
            {"streaming_per_request_timeout": 2.5},
            {"per_request_timeout_s": 2.5, "transaction_timeout_s": 33.5},
            id="timeout-float",
        ),
        pytest.param(
            {"streaming_retries": 0},
            {"retry": RetryPolicy(retries=0), "transaction_timeout_s": 600.0},
            id="no-retries",
        ),
        pytest.param(
            {"streaming_retries": 2, "streaming_retry_backoff_s": 0.25},
            {"retry": RetryPolicy(retries=2, backoff_s=0.25), "transaction_timeout_s": 600.75},
            id="retries-and-backoff",
        ),
        pytest.param({"streaming_max_requests_in_flight": 1}, {"max_in_flight": 1}, id="in-flight-1"),
        pytest.param({"streaming_max_requests_in_flight": 16}, {"max_in_flight": 16}, id="in-flight-16"),
        pytest.param({"streaming_min_throughput": 0}, {"min_throughput": 0}, id="no-min-throughput"),
        pytest.param({"streaming_min_throughput": 10 * MiB}, {"min_throughput": 10 * MiB}, id="min-throughput"),
        pytest.param(
            {"tensor_download_chunk_size": 0, "np_download_chunk_size": 0},
            {"tensor_chunk_bytes": 0, "array_chunk_bytes": 0},
            id="zero-chunks-inline",
        ),
        pytest.param(
            {"format_version": 2, "workflows": [], "cell": {"port": 0}, "np_download_chunk_size": 1024},
            {"array_chunk_bytes": 1024},
            id="other-keys-ignored",
        ),
    ],
)
def test_from_config(config: dict[str, Any], changed: dict[str, Any]) -> None:
    original = copy.deepcopy(config)

    context = StreamingContext.from_config(CELL, SERVICE, config)  # type: ignore[arg-type]

    assert settings_of(context) == {**DEFAULTS, **changed}
    assert (context.cell, context.service, context.consumer_factory) == (CELL, SERVICE, MemoryConsumer)
    assert config == original  # building never mutates the config


@pytest.mark.parametrize("side", SIDES)
def test_from_a_config_with_schema_defaults_gives_the_context_defaults(side: str) -> None:
    config = with_defaults({"format_version": 2}, side)

    context = StreamingContext.from_config(CELL, None, config, consumer_factory=DiskConsumer)  # type: ignore[arg-type]

    assert settings_of(context) == DEFAULTS
    assert context.service is None and context.consumer_factory is DiskConsumer


@pytest.mark.parametrize("side", SIDES)
def test_the_code_defaults_are_the_schema_defaults(side: str) -> None:
    defaults = top_level_defaults(side)

    assert defaults["tensor_download_chunk_size"] == defaults["np_download_chunk_size"] == DEFAULT_CHUNK_BYTES
    assert defaults["streaming_per_request_timeout"] == DEFAULT_PER_REQUEST_TIMEOUT_S
    assert defaults["streaming_max_requests_in_flight"] == DEFAULT_MAX_IN_FLIGHT == 4
    assert defaults["streaming_min_throughput"] == DEFAULT_MIN_THROUGHPUT == 256 * 1024
    assert defaults["streaming_retries"] == DEFAULT_RETRIES == 5
    assert defaults["streaming_retry_backoff_s"] == DEFAULT_RETRY_BACKOFF_S == 1.0


@pytest.mark.parametrize(
    ("config", "match"),
    [
        pytest.param(
            {"streaming_max_requests_in_flight": 0},
            r"streaming_max_requests_in_flight: expected an integer >= 1, got 0",
            id="in-flight-zero",
        ),
        pytest.param(
            {"streaming_max_requests_in_flight": True},
            r"streaming_max_requests_in_flight: expected an integer >= 1, got True",
            id="in-flight-bool",
        ),
        pytest.param(
            {"tensor_download_chunk_size": "2MB"},
            r"tensor_download_chunk_size: expected an integer >= 0, got '2MB'",
            id="chunk-string",
        ),
        pytest.param(
            {"np_download_chunk_size": -1}, r"np_download_chunk_size: expected an integer >= 0, got -1", id="chunk-neg"
        ),
        pytest.param(
            {"streaming_per_request_timeout": 0},
            r"streaming_per_request_timeout: expected seconds > 0, got 0",
            id="timeout-zero",
        ),
        pytest.param(
            {"streaming_retries": -1}, r"streaming_retries: expected an integer >= 0, got -1", id="retries-negative"
        ),
        pytest.param(
            {"streaming_retries": 2.0}, r"streaming_retries: expected an integer >= 0, got 2.0", id="retries-float"
        ),
        pytest.param(
            {"streaming_retry_backoff_s": 0},
            r"streaming_retry_backoff_s: expected seconds > 0, got 0",
            id="backoff-zero",
        ),
        pytest.param(
            {"streaming_retry_backoff_s": "1s"},
            r"streaming_retry_backoff_s: expected seconds > 0, got '1s'",
            id="backoff-string",
        ),
    ],
)
def test_from_an_unvalidated_config_names_the_bad_key(config: dict[str, Any], match: str) -> None:
    with pytest.raises(StreamingError, match=match):
        StreamingContext.from_config(CELL, SERVICE, config)  # type: ignore[arg-type]


def test_the_transaction_timeout_defaults_to_the_per_request_timeout_and_the_retries_unless_given() -> None:
    no_retry = RetryPolicy(retries=0)
    assert StreamingContext(CELL, per_request_timeout_s=7, retry=no_retry).transaction_timeout_s == 7  # type: ignore[arg-type]
    assert StreamingContext(CELL, per_request_timeout_s=7).transaction_timeout_s == 7 + 31  # type: ignore[arg-type]
    assert StreamingContext(CELL, transaction_timeout_s=90).transaction_timeout_s == 90  # type: ignore[arg-type]


HINT = "(a whole number of requests, at least 1, e.g. 4)"


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(8, [], id="valid"),
        pytest.param(1, [], id="minimum"),
        pytest.param(0, [f"c.conf: streaming_max_requests_in_flight: must be >= 1, got 0 {HINT}"], id="zero"),
        pytest.param(
            "four", [f'c.conf: streaming_max_requests_in_flight: expected an integer, got "four" {HINT}'], id="string"
        ),
        pytest.param(
            2.5, [f"c.conf: streaming_max_requests_in_flight: expected an integer, got 2.5 {HINT}"], id="float"
        ),
    ],
)
def test_schema_of_max_requests_in_flight(side: str, value: object, expected: list[str]) -> None:
    data: dict[str, Any] = {"format_version": 2, "streaming_max_requests_in_flight": value}
    data["workflows" if side == "config_fed_server" else "executors"] = (
        [{"id": "wf", "path": "a.B"}]
        if side == "config_fed_server"
        else [{"tasks": ["*"], "executor": {"path": "a.B"}}]
    )

    problems = [str(p) for p in check_document(ConfigDocument(Path("c.conf"), "c.conf", data), side)]

    assert problems == expected


def _document(side: str, **keys: object) -> ConfigDocument:
    data: dict[str, Any] = {"format_version": 2, **keys}
    data["workflows" if side == "config_fed_server" else "executors"] = (
        [{"id": "wf", "path": "a.B"}]
        if side == "config_fed_server"
        else [{"tasks": ["*"], "executor": {"path": "a.B"}}]
    )
    return ConfigDocument(Path("c.conf"), "c.conf", data)


RETRIES_HINT = "(a whole number of retries, 0 or more, e.g. 5)"
BACKOFF_HINT = "(seconds, greater than 0, e.g. 1)"


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        pytest.param({"streaming_retries": 0, "streaming_retry_backoff_s": 0.1}, [], id="valid"),
        pytest.param(
            {"streaming_retries": -1}, [f"c.conf: streaming_retries: must be >= 0, got -1 {RETRIES_HINT}"], id="neg"
        ),
        pytest.param(
            {"streaming_retries": "five"},
            [f'c.conf: streaming_retries: expected an integer, got "five" {RETRIES_HINT}'],
            id="retries-string",
        ),
        pytest.param(
            {"streaming_retry_backoff_s": 0},
            [f"c.conf: streaming_retry_backoff_s: must be > 0, got 0 {BACKOFF_HINT}"],
            id="backoff-zero",
        ),
    ],
)
def test_schema_of_the_retry_keys(side: str, keys: dict[str, object], expected: list[str]) -> None:
    problems = [str(p) for p in check_document(_document(side, **keys), side)]

    assert problems == expected
